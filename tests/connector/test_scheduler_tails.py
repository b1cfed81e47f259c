"""Tails (:mod:`tiercache.connector.tails`) in the scheduler half: the full blocks past a prompt's
last full chunk, which tails-on layouts look up (``LookupKind.TAIL``), load into their blocks and
store as one object of a chunk's first blocks that supersedes the shorter ones. Over the fake link
and lookup clients of :mod:`tests.connector.fakes`; the plans themselves (plain Python) are in
``test_tails_plan``.

Needs vLLM (the metadata derives from vLLM's); skipped elsewhere."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector metadata derives from vLLM's")

from tests.connector.fakes import (
    HIT_BYTES,
    HIT_TICKET,
    LookupClient,
    Reply,
    hit_reply,
    prompt_request,
    scheduler_half,
    scheduler_output,
    step_output,
)
from tiercache.config.connector import ConnectorSettings
from tiercache.connector.metadata import RequestLoad
from tiercache.connector.scheduler import SchedulerHalf
from tiercache.keys import ExtraKeys, ObjectKey, PrefixHasher, tail_hashes
from tiercache.keys.fingerprint import Fingerprint
from tiercache.wire.protocol import LookupKind, LookupReply, Slot, SlotColumns, TicketStateName


def _tails_scheduler(client: object, *, loads: bool = True) -> SchedulerHalf:
    """A dense scheduler (chunk 768 = 2 blocks of 384) with tails on."""
    return scheduler_half(client=client, recurrent=False, settings=ConnectorSettings(tails=True), loads=loads)


def test_tails_are_on_for_dense_layouts_and_off_for_recurrent_state() -> None:
    assert _tails_scheduler(object())._tail_block == 384
    assert scheduler_half(settings=ConnectorSettings(tails=True))._tail_block == 0
    assert scheduler_half(recurrent=False, settings=ConnectorSettings(tails=False))._tail_block == 0
    assert scheduler_half(recurrent=False, settings=ConnectorSettings())._tail_block == 384  # on by default


def test_a_hit_ends_at_the_last_tail_block_found_and_loads_it_into_its_block() -> None:
    """2000 tokens: 2 full chunks, then 1 full block of chunk 2 short of the last token. The
    server holds all three: the hit is 1920 tokens, the tail asked for every object of its block."""
    client = LookupClient(hit_reply(chunks=2))
    sched = _tails_scheduler(client)
    got = sched.get_num_new_matched_tokens(prompt_request(2000), 0)
    assert got == (2 * 768 + 384, False)
    (chunks, _), (blocks, tail_how) = client.asked
    assert (chunks, blocks) == (2, 1) and tail_how["kind"] is LookupKind.TAIL
    ids = list(range(1, 8))
    sched.update_state_after_alloc(
        SimpleNamespace(request_id="r"), SimpleNamespace(get_block_ids=lambda: (ids,)), 1920
    )
    meta = sched.build_connector_meta(scheduler_output([], {}, {}))
    (load,) = meta.loads
    assert [(c.block_ids, c.blocks) for c in load.chunks] == [([[1, 2]], 0), ([[3, 4]], 0), ([[5]], 1)]
    assert load.chunks[2].prefix_hash == client.hashes[0]


class _LateTailClient(LookupClient):
    """Answers each lookup by its own id: the chunks' at once (a hit of 2 in L1), a tail's only once
    ``tail_ready`` (a promotion from disk still running until then)."""

    def __init__(self) -> None:
        super().__init__(hit_reply(chunks=2))
        self.tail_ready = False
        self._sent: dict[int, tuple[list[bytes], bool]] = {}

    def lookup_async(self, hashes: list[bytes], groups: object, **how: Any) -> int:
        super().lookup_async(hashes, groups, **how)
        self._sent[len(self._sent) + 1] = (list(hashes), self.tail)
        return len(self._sent)

    def poll(self, req_id: int, wait_s: float = 0.0) -> LookupReply | None:
        self.hashes, self.tail = self._sent[req_id]
        if self.tail and not self.tail_ready:
            return None
        return super().poll(req_id, wait_s)


def test_chunks_the_engine_held_at_first_are_asked_for_once_it_evicted_them() -> None:
    """vLLM's own blocks held every full chunk when the request first came up, so the chunks were
    not asked for; while its tail's lookup waited, vLLM evicted most of those blocks. The chunks are
    asked for then, and the hit covers what the engine lost, instead of the engine computing it."""
    client = _LateTailClient()
    sched = _tails_scheduler(client)
    assert sched.get_num_new_matched_tokens(prompt_request(2000), 2 * 768) == (None, False)
    assert [how.get("kind") for _, how in client.asked] == [LookupKind.TAIL]  # the chunks: the engine's
    sched.build_connector_meta(scheduler_output([], {}, {}))  # a step without the request
    client.tail_ready = True
    got = sched.get_num_new_matched_tokens(prompt_request(2000), 384)  # one block left of its own
    assert [how.get("kind", LookupKind.CHUNKS) for _, how in client.asked] == [
        LookupKind.TAIL,
        LookupKind.CHUNKS,
    ]
    assert got == (2 * 768 + 384 - 384, False)  # both chunks and the tail block, past the engine's


class _PromotingChunksClient(LookupClient):
    """The chunks' lookup pending (a promotion from disk of the ``promised`` chunks it found) until
    ``ready``, then ready with ``kept`` of them; a tail's lookup answered at once (a hit in L1)."""

    def __init__(self, promised: int = 2, kept: int = 2) -> None:
        super().__init__(hit_reply(chunks=2))
        self.promised, self.kept, self.ready = promised, kept, False
        self._sent: dict[int, tuple[list[bytes], bool]] = {}

    def lookup_async(self, hashes: list[bytes], groups: object, **how: Any) -> int:
        super().lookup_async(hashes, groups, **how)
        self._sent[len(self._sent) + 1] = (list(hashes), self.tail)
        return len(self._sent)

    def poll_ticket_async(self, ticket: int) -> int:
        self._sent[len(self._sent) + 1] = self._sent[1]  # the chunks' ticket
        return len(self._sent)

    def poll(self, req_id: int, wait_s: float = 0.0) -> LookupReply | None:
        self.hashes, self.tail = self._sent[req_id]
        if self.tail:
            return super().poll(req_id, wait_s)
        if not self.ready:
            return LookupReply(
                chunks=self.promised,
                per_tier={"disk": self.promised},
                state=TicketStateName.PENDING,
                ticket=HIT_TICKET,
            )
        return hit_reply(chunks=self.kept)(self.hashes)


def _kinds(client: LookupClient) -> list[tuple[LookupKind, int]]:
    return [(how.get("kind", LookupKind.CHUNKS), n) for n, how in client.asked]


def test_the_tail_is_asked_for_while_the_chunks_are_promoted_at_the_hit_their_reply_promised() -> None:
    """The chunks' pending reply says two chunks are being promoted: the tail's lookup goes out at
    once, for the block after them, so its own promotion runs beside theirs instead of after."""
    client = _PromotingChunksClient()
    sched = _tails_scheduler(client)
    assert sched.get_num_new_matched_tokens(prompt_request(2000), 0) == (None, False)
    assert _kinds(client) == [(LookupKind.CHUNKS, 2), (LookupKind.TAIL, 1)]
    sched.build_connector_meta(scheduler_output([], {}, {}))  # a step without the request
    client.ready = True
    time.sleep(0.002)  # the ticket's first poll is due
    assert sched.get_num_new_matched_tokens(prompt_request(2000), 0) == (2 * 768 + 384, False)
    assert len(client.asked) == 2  # nothing asked twice


def test_a_tail_asked_early_at_a_hit_the_promotion_did_not_keep_is_asked_again_where_it_ends() -> None:
    """The promotion kept one of the two chunks it promised (the other failed): the tail asked for
    at chunk 2 does not join on, so it is released and the blocks of chunk 1 are asked for."""
    client = _PromotingChunksClient(promised=2, kept=1)
    sched = _tails_scheduler(client)
    assert sched.get_num_new_matched_tokens(prompt_request(2000), 0) == (None, False)
    sched.build_connector_meta(scheduler_output([], {}, {}))
    client.ready = True
    time.sleep(0.002)
    got = sched.get_num_new_matched_tokens(prompt_request(2000), 0)
    assert _kinds(client) == [(LookupKind.CHUNKS, 2), (LookupKind.TAIL, 1), (LookupKind.TAIL, 1)]
    assert got == (768 + 384, False)  # chunk 0, then the first block of chunk 1 (a tail found there)
    sched.build_connector_meta(scheduler_output([], {}, {}))  # the step built after it was dropped
    sched.update_connector_output(step_output())  # (the step before has run)
    assert client.released == []  # never while a step built before may still copy from it
    sched.update_connector_output(step_output())
    assert client.released == [HIT_TICKET]  # the early tail's ticket, once that step ran


def test_a_producer_stores_its_prompts_tail_and_never_asks_for_one() -> None:
    client = LookupClient(LookupReply(chunks=0, per_tier={}))
    sched = _tails_scheduler(client, loads=False)
    assert sched.get_num_new_matched_tokens(prompt_request(2000), 0) == (0, False)
    assert len(client.asked) == 1  # the chunks' lookup only
    new = SimpleNamespace(req_id="r", block_ids=(list(range(1, 8)),), num_computed_tokens=0)
    meta = sched.build_connector_meta(scheduler_output([new], {}, {"r": 2000}))
    assert [(s.chunk_index, s.block_ids, s.blocks) for s in meta.saves] == [
        (0, [[1, 2]], 0),
        (1, [[3, 4]], 0),
        (2, [[5]], 1),  # the full block of chunk 2 (tokens 1536..1919)
    ]
    # Each full chunk names the tail of its first block, which its commit supersedes.
    assert [len(s.supersedes) for s in meta.saves] == [1, 1, 0]


def test_a_finished_request_stores_its_generated_tokens_and_supersedes_the_prompts_tail() -> None:
    """A producer stores its prompt's tail once computed; when the request ends its generated
    tokens fill chunk 2, whose store supersedes that tail."""
    client = LookupClient(LookupReply(chunks=0, per_tier={}))
    sched = _tails_scheduler(client, loads=False)
    request = prompt_request(2000)
    sched.get_num_new_matched_tokens(request, 0)
    new = SimpleNamespace(req_id="r", block_ids=(list(range(1, 8)),), num_computed_tokens=0)
    prompt_tail = sched.build_connector_meta(scheduler_output([new], {}, {"r": 2000})).saves[-1]
    # 400 generated: the KV of all but the last sampled token exists, so chunk 2 is full now.
    done = SimpleNamespace(
        **vars(request), all_token_ids=[*range(2000), *range(400)], num_computed_tokens=2399
    )
    assert sched.request_finished(done) == (True, None)
    meta = sched.build_connector_meta(scheduler_output([], {}, {}))
    assert [(s.chunk_index, s.block_ids, s.blocks) for s in meta.saves] == [(2, [[5, 6]], 0)]
    assert meta.saves[0].supersedes == [prompt_tail.prefix_hash]


def test_a_request_stores_its_tail_once_at_its_end_with_its_prompts_blocks() -> None:
    """kv_both, a full-attention model: no tail when the prompt is computed; at the request's end,
    one object of the prompt's and the answer's full blocks of the last chunk."""
    client = LookupClient(LookupReply(chunks=0, per_tier={}))
    sched = _four_block_tails_scheduler(client)
    request = prompt_request(2000)
    request.max_tokens = 201  # (its answer may add blocks to the tail)
    sched.get_num_new_matched_tokens(request, 0)
    new = SimpleNamespace(req_id="r", block_ids=(list(range(1, 13)),), num_computed_tokens=0)
    meta = sched.build_connector_meta(scheduler_output([new], {}, {"r": 2000}))
    assert [s.blocks for s in meta.saves] == [0, 0]  # the two full chunks only
    done = SimpleNamespace(
        **vars(request), all_token_ids=[*range(2000), *range(200)], num_computed_tokens=2199
    )
    assert sched.request_finished(done) == (True, None)
    (tail,) = sched.build_connector_meta(scheduler_output([], {}, {})).saves
    assert (tail.chunk_index, tail.block_ids, tail.blocks) == (2, [[9, 10, 11]], 3)


def _four_block_tails_scheduler(client: object, *, loads: bool = True) -> SchedulerHalf:
    """A dense scheduler (chunk 768 = 4 blocks of 192, one layer of 196608 bytes a block) with tails on."""
    return scheduler_half(
        768, 192, client=client, recurrent=False, settings=ConnectorSettings(tails=True), loads=loads
    )


def _tail_reply(
    target: bytes, *, blocks: int, object_blocks: int, arena: str = "tiercache-arena"
) -> LookupReply:
    """A tail lookup's READY reply: ``blocks`` found in the object ``target`` of ``object_blocks``
    blocks (one layer of 196608 bytes a block), pinned under ticket ``HIT_TICKET + 1`` in ``arena``."""
    key = ObjectKey(Fingerprint(bytes(16)), 0, target).to_bytes()
    return LookupReply(
        chunks=blocks,
        per_tier={"l1": 1},
        state=TicketStateName.READY,
        ticket=HIT_TICKET + 1,
        ready_chunks=1,
        held=SlotColumns.of([Slot(key, 0, object_blocks * 196608, 200)]),
        arena=arena,
    )


class _SequencedClient(LookupClient):
    """Answers the lookups with ``replies`` in turn (each a reply, or a function of the hashes asked)."""

    def __init__(self, *replies: Reply) -> None:
        super().__init__(None)
        self._replies = list(replies)

    def lookup_async(self, hashes: list[bytes], groups: object, **how: Any) -> int:
        self.reply = self._replies.pop(0)
        return super().lookup_async(hashes, groups, **how)


def test_a_tail_lookup_answered_with_the_chunk_holding_the_blocks_loads_its_first_blocks() -> None:
    """2000 tokens: 2 full chunks, then 2 full blocks of chunk 2 short of the last token. The server
    holds chunk 2 whole (stored by a longer request): its block index answers the tail lookup with
    that object, keyed by a hash this prompt cannot name, and the load reads its first 2 blocks."""
    chunk2 = b"\x07" * 16  # the whole chunk's prefix hash
    client = _SequencedClient(hit_reply(chunks=2), _tail_reply(chunk2, blocks=2, object_blocks=4))
    sched = _four_block_tails_scheduler(client)
    assert sched.get_num_new_matched_tokens(prompt_request(2000), 0) == (2 * 768 + 2 * 192, False)
    ids = list(range(1, 12))
    sched.update_state_after_alloc(
        SimpleNamespace(request_id="r"), SimpleNamespace(get_block_ids=lambda: (ids,)), 1920
    )
    (load,) = sched.build_connector_meta(scheduler_output([], {}, {})).loads
    tail = load.chunks[-1]
    assert (tail.prefix_hash, tail.positions, tail.block_ids, tail.blocks) == (chunk2, [[0, 1]], [[9, 10]], 4)


def _tail_load(client: object) -> RequestLoad:
    """The load a 2000-token prompt gets from ``client``'s replies (two chunks, then a tail of 2
    blocks in chunk 2), once its blocks are allocated; the step that carries it has run."""
    sched = _four_block_tails_scheduler(client)
    sched.get_num_new_matched_tokens(prompt_request(2000), 0)
    ids = list(range(1, 12))
    sched.update_state_after_alloc(
        SimpleNamespace(request_id="r"), SimpleNamespace(get_block_ids=lambda: (ids,)), 1920
    )
    (load,) = sched.build_connector_meta(scheduler_output([], {}, {})).loads
    sched.update_connector_output(step_output())
    return load


def test_a_load_names_where_the_lookups_tickets_pinned_its_objects_and_when_they_were_sent() -> None:
    """So the workers copy from there without pinning again: each chunk's slot per object group,
    the tail object's too, the arena the replies said they are in, and the earliest send of the
    lookups that pinned them (no lease of theirs started before it). The tickets are released as
    read: the server counts their objects as L1 hits."""
    chunk2 = b"\x07" * 16
    client = _SequencedClient(hit_reply(chunks=2), _tail_reply(chunk2, blocks=2, object_blocks=4))
    before = time.monotonic()
    load = _tail_load(client)
    assert load.arena == "tiercache-arena" and before <= load.leased_at <= time.monotonic()
    assert [c.slots for c in load.chunks] == [
        [(0, 0, HIT_BYTES, 0)],
        [(0, HIT_BYTES, HIT_BYTES, 0)],
        [(0, 0, 4 * 196608, 0)],  # the tail object's, from the tail lookup's reply
    ]
    assert sorted(client.released) == [HIT_TICKET, HIT_TICKET + 1] and client.read == [True, True]


def test_slots_from_two_arenas_are_not_named_the_workers_pin_by_key() -> None:
    """The chunks' lookup answered by one server and the tail's by another (restarted in between:
    the client says hello again by itself): no single arena holds every slot, so the load names
    none, and its tickets are not counted as read."""
    chunk2 = b"\x07" * 16
    client = _SequencedClient(
        hit_reply(chunks=2, arena="tiercache-old"), _tail_reply(chunk2, blocks=2, object_blocks=4)
    )
    load = _tail_load(client)
    assert load.arena == "" and load.leased_at == 0.0
    assert client.read == [False, False]


def test_a_tail_lookup_answered_with_an_object_of_the_wrong_size_is_a_miss() -> None:
    """An object that cannot hold the blocks the reply counts (here 1 block for 2) is never loaded."""
    client = _SequencedClient(hit_reply(chunks=2), _tail_reply(b"\x07" * 16, blocks=2, object_blocks=1))
    sched = _four_block_tails_scheduler(client)
    assert sched.get_num_new_matched_tokens(prompt_request(2000), 0) == (2 * 768, False)
    assert HIT_TICKET + 1 in client.released or sched._reqs["r"].tail.probe.ticket == 0


def test_a_tail_is_one_object_of_the_chunks_first_blocks_superseding_the_shorter_one() -> None:
    """A producer's prompt of 2000 tokens stores chunk 2's first 2 blocks as one object keyed by the
    second's tail hash; the request ends (here after more tokens) with 3 full blocks there, stored as one object of all 3
    that supersedes the first. Each names the blocks it holds, for the server's block index."""
    client = LookupClient(LookupReply(chunks=0, per_tier={}))
    sched = _four_block_tails_scheduler(client, loads=False)  # a producer: its prompt's tail at once
    request = prompt_request(2000)
    sched.get_num_new_matched_tokens(request, 0)
    new = SimpleNamespace(req_id="r", block_ids=(list(range(1, 13)),), num_computed_tokens=0)
    meta = sched.build_connector_meta(scheduler_output([new], {}, {"r": 2000}))
    tokens = [*range(2000), *range(200)]
    hasher = PrefixHasher(768, ExtraKeys())
    hasher.update(tokens)
    t = tail_hashes(hasher.before(2), tokens[1536 : 1536 + 3 * 192], 192)
    chunk0, _chunk1, prompt_tail = meta.saves
    assert (prompt_tail.chunk_index, prompt_tail.block_ids, prompt_tail.blocks) == (2, [[9, 10]], 2)
    assert (prompt_tail.prefix_hash, prompt_tail.holds, prompt_tail.supersedes) == (t[1], t[:2], t[:1])
    # A full chunk holds its first 3 blocks' tails and supersedes them.
    assert len(chunk0.holds) == len(chunk0.supersedes) == 3 and chunk0.holds == chunk0.supersedes
    done = SimpleNamespace(**vars(request), all_token_ids=tokens, num_computed_tokens=2199)
    assert sched.request_finished(done) == (True, None)
    (end_tail,) = sched.build_connector_meta(scheduler_output([], {}, {})).saves
    assert (end_tail.chunk_index, end_tail.block_ids, end_tail.blocks) == (2, [[9, 10, 11]], 3)
    assert (end_tail.prefix_hash, end_tail.holds, end_tail.supersedes) == (t[2], t, t[:2])


def test_a_request_whose_answer_cannot_add_a_block_stores_its_tail_once_its_prompt_is_computed() -> None:
    """max_tokens 8 after 2000 tokens (blocks of 192): the KV at the end stays inside the prompt's
    last block, so the end's tail would be the prompt's: stored at once (not lost if no step
    follows the request's end, as after an offline generate call's last request)."""
    client = LookupClient(LookupReply(chunks=0, per_tier={}))
    sched = _four_block_tails_scheduler(client)
    request = prompt_request(2000)
    request.max_tokens = 8
    sched.get_num_new_matched_tokens(request, 0)
    new = SimpleNamespace(req_id="r", block_ids=(list(range(1, 13)),), num_computed_tokens=0)
    meta = sched.build_connector_meta(scheduler_output([new], {}, {"r": 2000}))
    assert [(s.chunk_index, s.blocks) for s in meta.saves] == [(0, 0), (1, 0), (2, 2)]
    done = SimpleNamespace(**vars(request), all_token_ids=[*range(2000), *range(8)], num_computed_tokens=2007)
    assert sched.request_finished(done) == (True, None)
    assert not sched.build_connector_meta(scheduler_output([], {}, {})).saves


def test_a_replay_that_found_its_own_tail_does_not_store_it_again() -> None:
    """A request whose tail lookup found the very object its end would store (the same blocks: a
    replay of a stored turn) stores nothing at its end."""
    tokens = [*range(2000), *range(200)]
    hasher = PrefixHasher(768, ExtraKeys())
    hasher.update(tokens)
    end_tail = tail_hashes(hasher.before(2), tokens[1536 : 1536 + 3 * 192], 192)[-1]
    client = _SequencedClient(hit_reply(chunks=2), _tail_reply(end_tail, blocks=2, object_blocks=3))
    sched = _four_block_tails_scheduler(client)
    request = prompt_request(2000)
    request.max_tokens = 201
    assert sched.get_num_new_matched_tokens(request, 0) == (2 * 768 + 2 * 192, False)
    ids = list(range(1, 13))
    sched.update_state_after_alloc(
        SimpleNamespace(request_id="r"), SimpleNamespace(get_block_ids=lambda: (ids,)), 1920
    )
    new = SimpleNamespace(req_id="r", block_ids=(ids,), num_computed_tokens=1920)
    sched.build_connector_meta(scheduler_output([new], {}, {"r": 80}))
    done = SimpleNamespace(**vars(request), all_token_ids=tokens, num_computed_tokens=2199)
    sched.request_finished(done)
    assert not sched.build_connector_meta(scheduler_output([], {}, {})).saves
