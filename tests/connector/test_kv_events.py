"""Specification: the connector publishes, as vLLM KV events, which tiers of its server hold the
chunks and tails its engine stored (``BlockStored`` per tier it lands in, ``BlockRemoved`` when a
tier drops it), with the block hashes, token ids and extra keys vLLM itself would publish for those
blocks; a block another followed object still holds in that tier (a tail and the chunk covering
it) is never published as removed there.

A real server process and vLLM's own ``Request`` (with vLLM's block hasher), and for the orders of
the server's log a scripted log (:class:`ScriptedLog`); the end-to-end cases through vLLM's OpenAI
server and its ZMQ publisher are ``tests/e2e/test_kv_events.py``."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request

import tiercache.connector.events as events_module
from tests.server.conftest import manifest
from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.client.client import Client
from tiercache.config.connector import ConnectorSettings
from tiercache.connector.events import KVEventTracker
from tiercache.keys import ExtraKeys, Fingerprint, ObjectKey, PrefixHasher, chunk_hashes, tail_hashes
from tiercache.keys.digest import digest
from tiercache.testing.poll import wait_until
from tiercache.wire import protocol as p

CHUNK = 256  # the test server's chunk size (tests/server/conftest.py)
BLOCK = 16
PER = CHUNK // BLOCK  # blocks per chunk
MiB = 1 << 20


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        ServerSpec(
            listen=f"ipc://{tmp_path}/server.sock",
            disk_path=str(tmp_path / "lmdb"),
            options={"chunk_size": CHUNK},
        )
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def published(request: Request) -> list[Any]:
    """The request's block hashes as vLLM publishes them (64-bit ints by default)."""
    return [maybe_convert_block_hash(h) for h in request.block_hashes]


def vllm_request(tokens: list[int], salt: str | None = None) -> Request:
    init_none_hash(sha256_cbor)
    return Request(
        "r1",
        tokens,
        SamplingParams(max_tokens=1),
        None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(BLOCK, sha256_cbor),
    )


class Engine:
    """One engine's view: its tracker, its client and the keys of its stored chunks."""

    def __init__(self, server: ServerProcess, **settings: Any) -> None:
        self.client = Client(server.endpoint, timeout=5)
        [self.group] = self.client.register([(0, manifest())])
        self.fingerprint = Fingerprint(self.group.fingerprint)
        self.tracker = KVEventTracker(ConnectorSettings(kv_events_interval_s=0.01, **settings), BLOCK)
        self.tracker.use_anchor(self.fingerprint, 0)
        self.tracker.on_connect(self.client)

    def store(self, request: Request, chunks: int) -> list[ObjectKey]:
        hashes = chunk_hashes(request.prompt_token_ids, CHUNK)[:chunks]
        keys = [ObjectKey(self.fingerprint, 0, h) for h in hashes]
        for c, h in enumerate(hashes):
            self.tracker.remember(request, c, CHUNK, h)
        assert self.client.store_chunks(keys, [os.urandom(4096) for _ in keys]) == len(keys)
        return keys

    def events(self, until: int) -> list[Any]:
        """Events gathered until at least ``until`` have come."""
        got: list[Any] = []

        def enough() -> bool:
            got.extend(self.tracker.take(self.client))
            return len(got) >= until

        wait_until(enough, timeout=10, what=f"{until} KV events")
        return got


def test_a_stored_chunk_is_published_per_tier_with_the_blocks_vllm_would_publish(
    server: ServerProcess,
) -> None:
    engine = Engine(server)
    tokens = list(range(1000, 1000 + 3 * CHUNK + 10))
    request = vllm_request(tokens)
    engine.store(request, 3)
    events = engine.events(until=6)  # 3 chunks x (L1, then disk by write-through)
    assert all(isinstance(e, BlockStored) for e in events)
    by_medium: dict[str, list[BlockStored]] = {}
    for e in events:
        by_medium.setdefault(e.medium, []).append(e)
    assert sorted(by_medium) == ["CPU", "DISK"]
    per = CHUNK // BLOCK
    for stored in by_medium.values():
        stored.sort(key=lambda e: tokens.index(e.token_ids[0]))
        assert [e.block_hashes for e in stored] == [
            published(request)[c * per : (c + 1) * per] for c in range(3)
        ]
        assert [e.token_ids for e in stored] == [tokens[c * CHUNK : (c + 1) * CHUNK] for c in range(3)]
        assert stored[0].parent_block_hash is None
        assert stored[1].parent_block_hash == published(request)[per - 1]
        assert {e.block_size for e in stored} == {BLOCK}
        assert {e.locality for e in stored} == {"LOCAL"}

    # A router hashing like vLLM finds the same hashes from the events' token ids alone.
    parent = None
    for e in by_medium["CPU"]:
        assert e.parent_block_hash == (None if parent is None else maybe_convert_block_hash(parent))
        for i, h in enumerate(e.block_hashes):
            parent = hash_block_tokens(sha256_cbor, parent, e.token_ids[i * BLOCK : (i + 1) * BLOCK], None)
            assert maybe_convert_block_hash(parent) == h


def test_the_cache_salt_travels_as_vllm_publishes_it(server: ServerProcess) -> None:
    engine = Engine(server)
    request = vllm_request(list(range(5, 5 + CHUNK + 1)), salt="tenant-a")
    engine.store(request, 1)
    stored = [e for e in engine.events(until=1) if e.medium == "CPU"]
    [event] = stored
    assert event.extra_keys[0] == ("tenant-a",)  # untagged, on the first block only, like vLLM's own
    assert all(k is None for k in event.extra_keys[1:])


def test_a_tier_that_drops_a_chunk_publishes_its_removal(server: ServerProcess) -> None:
    engine = Engine(server)
    request = vllm_request(list(range(7, 7 + 2 * CHUNK + 1)))
    keys = engine.store(request, 2)
    engine.events(until=4)
    assert engine.client.delete(keys[0]) == 2  # from L1 and from disk
    removed = engine.events(until=2)
    assert all(isinstance(e, BlockRemoved) for e in removed)
    assert sorted(e.medium for e in removed) == ["CPU", "DISK"]
    assert all(e.block_hashes == published(request)[: CHUNK // BLOCK] for e in removed)


def test_chunks_beyond_the_bound_are_retracted_not_left_stale(server: ServerProcess) -> None:
    engine = Engine(server, kv_events_chunks=1)
    first = vllm_request(list(range(11, 11 + CHUNK + 1)))
    engine.store(first, 1)
    engine.events(until=2)
    second = vllm_request(list(range(4000, 4000 + CHUNK + 1)))
    engine.store(second, 1)  # the first chunk is forgotten: a router must not keep it on our word
    events = engine.events(until=4)
    retracted = [e for e in events if isinstance(e, BlockRemoved)]
    assert sorted(e.medium for e in retracted) == ["CPU", "DISK"]
    assert all(e.block_hashes == published(first)[: CHUNK // BLOCK] for e in retracted)
    assert engine.tracker.counts["retracted_chunks"] == 1


def test_a_restarted_server_retracts_what_its_memory_held(tmp_path: Path, server: ServerProcess) -> None:
    engine = Engine(server)
    engine.store(vllm_request(list(range(50, 50 + CHUNK + 1))), 1)
    engine.events(until=2)
    other = ServerProcess(ServerSpec(listen=f"ipc://{tmp_path}/other.sock", options={"chunk_size": CHUNK}))
    try:
        other.wait_ready()
        with Client(other.endpoint, timeout=5) as moved:
            engine.tracker.on_connect(moved)  # as after a reconnect to a new server instance
            [event] = engine.events(until=1)
        assert isinstance(event, BlockRemoved) and event.medium == "CPU"  # the disk copy is still there
    finally:
        other.stop()


def test_no_events_are_published_while_vllm_publishes_none(server: ServerProcess) -> None:
    tracker = KVEventTracker(ConnectorSettings(kv_events_interval_s=0), BLOCK)
    with Client(server.endpoint, timeout=5) as client:
        tracker.on_connect(client)
        tracker.remember(vllm_request(list(range(CHUNK + 1))), 0, CHUNK, bytes(16))
        assert tracker.take(client) == []


def test_the_engine_keeps_stepping_until_its_stores_are_reported(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM collects take_events() only while its engine steps: the connector reports pending work
    # (has_pending_push_work) from a store's planning until every local tier the server writes a
    # chunk to (L1, then this server's disk by write-behind) reports it, so an idle engine does
    # not hold the DISK event back until its next request.
    engine = Engine(server)
    request = vllm_request(list(range(90, 90 + CHUNK + 1)))
    assert not engine.tracker.busy()
    engine.store(request, 1)
    assert engine.tracker.busy()
    got = engine.events(until=2)
    assert sorted(e.medium for e in got) == ["CPU", "DISK"]
    assert not engine.tracker.busy()
    # A store the server dropped is never reported: it stops holding the engine after a while.
    monkeypatch.setattr(events_module, "CONFIRM_WITHIN_S", 0.0)
    engine.tracker.remember(vllm_request(list(range(7000, 7000 + CHUNK + 1))), 0, CHUNK, bytes(16))
    assert not engine.tracker.busy()


# -- tails -------------------------------------------------------------------------------------


def fold(events: Iterable[Any], held: set[tuple[str, Any]] | None = None) -> set[tuple[str, Any]]:
    """What a router folding ``events`` believes this replica holds: (medium, block hash)."""
    held = set() if held is None else held
    for e in events:
        if isinstance(e, BlockStored):
            held.update((e.medium, h) for h in e.block_hashes)
        elif isinstance(e, BlockRemoved):
            held.difference_update((e.medium, h) for h in e.block_hashes)
    return held


def tail_keys(engine_fingerprint: Fingerprint, tokens: list[int], chunk: int, blocks: int) -> list[ObjectKey]:
    """The anchor keys of the first ``blocks`` tails of ``tokens``' chunk ``chunk``."""
    hasher = PrefixHasher(CHUNK, ExtraKeys())
    hasher.update(tokens)
    hashes = tail_hashes(hasher.before(chunk), tokens[chunk * CHUNK : chunk * CHUNK + blocks * BLOCK], BLOCK)
    return [ObjectKey(engine_fingerprint, 0, h) for h in hashes]


def store_objects(
    client: Client, keys: list[ObjectKey], nbytes: int, supersedes: list[ObjectKey] | None = None
) -> None:
    """Reserve, fill and commit one object per key, the commit naming the tails it ``supersedes``
    (as the worker's commit of a full chunk does)."""
    slots = client.reserve([(k, nbytes) for k in keys])
    arena = client.arena()
    digests = []
    for slot in slots:
        assert slot is not None
        data = os.urandom(nbytes)
        arena.view(slot.offset, slot.nbytes)[:] = data
        digests.append(digest(data))
    tokens = [s.token for s in slots if s is not None]
    assert client.commit(tokens, digests, supersedes=supersedes or ()) == len(keys)


def test_a_stored_tail_is_published_per_tier_with_the_blocks_vllm_would_publish(
    server: ServerProcess,
) -> None:
    """A tail is one object of its chunk's first blocks (here 3), keyed by the tail hash of its
    last: one ``BlockStored`` per tier with those blocks' hashes, as vLLM publishes them."""
    engine = Engine(server)
    tokens = list(range(300, 300 + CHUNK + 3 * BLOCK + 5))  # chunk 0, then 3 full blocks of chunk 1
    request = vllm_request(tokens, salt="tenant-a")
    tail = tail_keys(engine.fingerprint, tokens, 1, 3)[-1]
    engine.tracker.remember_tail(request, 1, CHUNK, 0, 3 * BLOCK, tail.prefix_hash)
    salted = tail_keys(engine.fingerprint, tokens, 0, 1)  # (a salted request's tiercache keys differ)
    engine.tracker.remember_tail(request, 0, CHUNK, 0, BLOCK, salted[0].prefix_hash)
    store_objects(engine.client, [tail, *salted], 256)
    events = engine.events(until=4)  # 2 tails x (L1, then disk by write-through)
    assert all(isinstance(e, BlockStored) for e in events)
    assert sorted(e.medium for e in events) == ["CPU"] * 2 + ["DISK"] * 2
    hashes = published(request)
    for e in events:
        at = hashes.index(e.block_hashes[0])
        assert e.block_hashes == hashes[at : at + len(e.block_hashes)]
        assert (at, len(e.block_hashes)) in ((0, 1), (PER, 3))
        assert e.parent_block_hash == (hashes[at - 1] if at else None)
        assert e.token_ids == tokens[at * BLOCK : (at + len(e.block_hashes)) * BLOCK]
        assert e.block_size == BLOCK and e.locality == "LOCAL"
        # The salt on the prompt's first block only, untagged, like vLLM's own events.
        assert e.extra_keys == ([("tenant-a",)] if at == 0 else [None] * 3)
    # A router hashing like vLLM finds the tail's hashes from its parent and token ids alone.
    e = next(e for e in events if e.block_hashes[0] == hashes[PER])
    parent = request.block_hashes[PER - 1]
    for i, h in enumerate(e.block_hashes):
        parent = hash_block_tokens(sha256_cbor, parent, e.token_ids[i * BLOCK : (i + 1) * BLOCK], None)
        assert maybe_convert_block_hash(parent) == h


def test_a_tail_superseded_by_a_longer_one_is_never_published_as_removed(chat: Any) -> None:
    """A request's tail of 2 blocks, then (the request went on) one of 3 that supersedes it."""
    log = ScriptedLog()
    request, tails, _chunk = chat
    log.tracker.remember_tail(request, 1, CHUNK, 0, 2 * BLOCK, tails[1])
    held = fold(log.step(("stored", "l1", log.key(tails[1]))))
    log.tracker.remember_tail(request, 1, CHUNK, 0, 3 * BLOCK, tails[2])
    events = log.step(("stored", "l1", log.key(tails[2])), ("removed", "l1", log.key(tails[1])))
    assert not removed_blocks(events, "CPU")
    assert fold(events, held) == {("CPU", h) for h in published(request)[PER : PER + 3]}


def test_tails_superseded_by_their_chunk_are_never_published_as_removed(server: ServerProcess) -> None:
    """The real server's order: the chunk's commit (its L1 arrival), then the superseded tails'
    removal from L1 and disk; the chunk's disk copy lands later, by write-through."""
    engine = Engine(server)
    tokens = list(range(2000, 2000 + 2 * CHUNK + 1))
    request = vllm_request(tokens)
    tails = tail_keys(engine.fingerprint, tokens, 1, PER - 1)
    for j, key in enumerate(tails):
        engine.tracker.remember_tail(request, 1, CHUNK, j, BLOCK, key.prefix_hash)
    store_objects(engine.client, tails, 256)
    events = engine.events(until=2 * len(tails))
    held = fold(events)
    assert held == {(m, h) for m in ("CPU", "DISK") for h in published(request)[PER : 2 * PER - 1]}

    [_, chunk1] = chunk_hashes(tokens, CHUNK)
    engine.tracker.remember(request, 1, CHUNK, chunk1)
    store_objects(engine.client, [ObjectKey(engine.fingerprint, 0, chunk1)], 4096, supersedes=tails)
    assert engine.client.stats()["engine"]["tails_superseded"] == 2 * len(tails)  # from L1 and disk
    # A chunk stored afterwards: once its events come, every change before it has been read.
    later = vllm_request(list(range(9000, 9000 + CHUNK + 1)))
    engine.store(later, 1)
    wanted = {("CPU", h) for h in published(later)[:PER]} | {
        ("DISK", h) for h in published(request)[PER : 2 * PER]
    }
    got: list[Any] = []

    def read() -> bool:
        got.extend(engine.tracker.take(engine.client))
        return wanted <= fold(got, set(held))

    wait_until(read, timeout=10, what="the covering chunk's and the later chunk's events")
    # No CPU removal at all: the chunk was in L1 before its tails left it. Whatever the disk's
    # order (its tail copies went at the commit, the chunk's copy lands by write-through), the
    # router ends holding every block of the chunk in both media.
    assert not [e for e in got if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    held = fold(got, held)
    assert {(m, h) for m in ("CPU", "DISK") for h in published(request)[PER : 2 * PER]} <= held
    assert engine.tracker.counts["covered_blocks"] >= len(tails)


def test_a_tail_removed_with_no_chunk_covering_it_is_published(server: ServerProcess) -> None:
    engine = Engine(server)
    tokens = list(range(5000, 5000 + CHUNK + 2 * BLOCK + 1))
    request = vllm_request(tokens)
    tails = tail_keys(engine.fingerprint, tokens, 1, 2)
    for j, key in enumerate(tails):
        engine.tracker.remember_tail(request, 1, CHUNK, j, BLOCK, key.prefix_hash)
    store_objects(engine.client, tails, 256)
    engine.events(until=4)
    assert engine.client.delete(tails[1]) == 2  # from L1 and from disk
    removed = engine.events(until=2)
    assert all(isinstance(e, BlockRemoved) for e in removed)
    assert sorted(e.medium for e in removed) == ["CPU", "DISK"]
    assert all(e.block_hashes == [published(request)[PER + 1]] for e in removed)


class ScriptedLog:
    """A server's residency log whose replies the test writes, one per :meth:`step`."""

    INSTANCE = b"instance"

    def __init__(self, **settings: Any) -> None:
        self.fingerprint = Fingerprint(bytes(16))
        self.tracker = KVEventTracker(ConnectorSettings(kv_events_interval_s=1e-6, **settings), BLOCK)
        self.tracker.use_anchor(self.fingerprint, 0)
        self.tracker.on_connect(self)  # type: ignore[arg-type]
        self._replies: list[p.EventsReply] = []
        self._seq = 0
        self.local_tiers: list[str] = []  # what the scripted server says every object lands in
        self._asked = False

    # -- what the tracker calls ----------------------------------------------------------------
    def events(
        self,
        since: int = -1,
        fingerprints: Sequence[Fingerprint] = (),
        limit: int = 10_000,
        timeout: float | None = None,
    ) -> p.EventsReply:
        return p.EventsReply(instance=self.INSTANCE, next_seq=0)

    def events_async(
        self, since: int = -1, fingerprints: Sequence[Fingerprint] = (), limit: int = 10_000
    ) -> int:
        self._asked = True
        return 1

    def poll(self, req_id: int, wait_s: float = 0.0) -> p.EventsReply | None:
        if not self._asked or not self._replies:
            return None
        self._asked = False
        return self._replies.pop(0)

    # -- what the test does --------------------------------------------------------------------
    def key(self, prefix_hash: bytes) -> bytes:
        return ObjectKey(self.fingerprint, 0, prefix_hash).to_bytes()

    def step(
        self, *changes: tuple[str, str, bytes], lost: bool = False, instance: bytes = INSTANCE
    ) -> list[Any]:
        """One reply carrying ``changes`` (``stored``/``removed``, tier, key): the events the
        tracker publishes once it has read it."""
        events = []
        for kind, tier, key in changes:
            self._seq += 1
            events.append(p.ResidencyEvent(self._seq, p.EventKind(kind), tier, key))
        self._replies.append(
            p.EventsReply(
                instance=instance, next_seq=self._seq, events=events, lost=lost, local_tiers=self.local_tiers
            )
        )
        out: list[Any] = []
        while self._replies:
            out.extend(self.tracker.take(self))  # type: ignore[arg-type]
        return out


@pytest.fixture
def chat() -> tuple[Request, list[bytes], bytes]:
    """A request of two full chunks; the tail hashes of chunk 1's blocks and chunk 1's hash."""
    tokens = list(range(100, 100 + 2 * CHUNK + 1))
    hasher = PrefixHasher(CHUNK, ExtraKeys())
    hasher.update(tokens)
    tails = tail_hashes(hasher.before(1), tokens[CHUNK : 2 * CHUNK - BLOCK], BLOCK)
    return vllm_request(tokens), tails, chunk_hashes(tokens, CHUNK)[1]


def remember_chat(log: ScriptedLog, chat: tuple[Request, list[bytes], bytes]) -> tuple[list[bytes], bytes]:
    """The tracker plans chunk 1's tails, then chunk 1 (as a second turn fills it): their keys."""
    request, tails, chunk = chat
    for j, h in enumerate(tails):
        log.tracker.remember_tail(request, 1, CHUNK, j, BLOCK, h)
    log.tracker.remember(request, 1, CHUNK, chunk)
    return [log.key(h) for h in tails], log.key(chunk)


def removed_blocks(events: list[Any], medium: str) -> list[Any]:
    return [h for e in events if isinstance(e, BlockRemoved) and e.medium == medium for h in e.block_hashes]


def test_a_tails_removal_before_its_chunks_arrival_in_the_same_reply_is_no_removal(chat: Any) -> None:
    log = ScriptedLog()
    tails, chunk = remember_chat(log, chat)
    held = fold(log.step(*(("stored", "l1", t) for t in tails)))
    out = log.step(*(("removed", "l1", t) for t in tails), ("stored", "l1", chunk))
    assert not removed_blocks(out, "CPU")
    assert fold(out, held) == {("CPU", h) for h in published(chat[0])[PER : 2 * PER]}
    assert log.tracker.counts["covered_blocks"] == len(tails)


def test_a_tails_removal_read_after_its_chunks_arrival_is_no_removal(chat: Any) -> None:
    log = ScriptedLog()
    tails, chunk = remember_chat(log, chat)
    held = fold(log.step(*(("stored", "l1", t) for t in tails)))
    held = fold(log.step(("stored", "l1", chunk)), held)
    out = log.step(*(("removed", "l1", t) for t in tails))
    assert out == []
    assert held == {("CPU", h) for h in published(chat[0])[PER : 2 * PER]}


def test_a_tails_removal_read_before_its_chunk_arrives_is_published_then_stored_again(chat: Any) -> None:
    """Between the two replies the tier held none of it: the router is told so, and the chunk's
    arrival announces every block again."""
    log = ScriptedLog()
    tails, chunk = remember_chat(log, chat)
    held = fold(log.step(*(("stored", "disk", t) for t in tails)))
    out = log.step(*(("removed", "disk", t) for t in tails))
    assert sorted(removed_blocks(out, "DISK")) == sorted(published(chat[0])[PER : 2 * PER - 1])
    held = fold(out, held)
    assert held == set()
    held = fold(log.step(("stored", "disk", chunk)), held)
    assert held == {("DISK", h) for h in published(chat[0])[PER : 2 * PER]}


def test_a_chunk_covers_its_tails_only_in_the_media_it_is_in(chat: Any) -> None:
    log = ScriptedLog()
    tails, chunk = remember_chat(log, chat)
    held = fold(log.step(*(("stored", tier, t) for t in tails for tier in ("l1", "disk"))))
    held = fold(log.step(("stored", "l1", chunk)), held)  # not on disk (yet)
    out = log.step(*(("removed", tier, t) for t in tails for tier in ("l1", "disk")))
    assert not removed_blocks(out, "CPU")
    assert sorted(removed_blocks(out, "DISK")) == sorted(published(chat[0])[PER : 2 * PER - 1])
    assert fold(out, held) == {("CPU", h) for h in published(chat[0])[PER : 2 * PER]}


def test_a_chunk_leaving_a_tier_its_tail_is_still_in_spares_the_tails_block(chat: Any) -> None:
    """S3 is not asked to drop superseded tails: there a tail and its chunk can both be held."""
    log = ScriptedLog()
    tails, chunk = remember_chat(log, chat)
    held = fold(log.step(("stored", "s3", tails[0]), ("stored", "s3", chunk)))
    out = log.step(("removed", "s3", chunk))
    hashes = published(chat[0])
    assert removed_blocks(out, "S3") == hashes[PER + 1 : 2 * PER]
    held = fold(out, held)
    assert held == {("S3", hashes[PER])}
    assert fold(log.step(("removed", "s3", tails[0])), held) == set()


def test_retractions_leave_nothing_held_and_name_each_block_once(chat: Any) -> None:
    log = ScriptedLog()
    tails, chunk = remember_chat(log, chat)
    everything = [
        (kind, tier, k) for k in (*tails, chunk) for kind, tier in (("stored", "l1"), ("stored", "disk"))
    ]
    held = fold(log.step(*everything))
    # A restarted server (a new instance): its L1 is empty, the disk keeps its copies.
    out = log.step(instance=b"restart")
    assert sorted(removed_blocks(out, "CPU")) == sorted(published(chat[0])[PER : 2 * PER])  # once each
    held = fold(out, held)
    assert held == {("DISK", h) for h in published(chat[0])[PER : 2 * PER]}
    # A gap in the log: what the disk holds is unknown now.
    out = log.step(lost=True, instance=b"restart")
    assert sorted(removed_blocks(out, "DISK")) == sorted(published(chat[0])[PER : 2 * PER])
    assert fold(out, held) == set()


def test_a_tail_counts_one_block_toward_the_bound_and_is_retracted_when_forgotten() -> None:
    log = ScriptedLog(kv_events_chunks=1)  # room for one chunk's blocks: 16 tails
    tokens = list(range(700, 700 + 2 * CHUNK + 1))
    request = vllm_request(tokens)
    hasher = PrefixHasher(CHUNK, ExtraKeys())
    hasher.update(tokens)
    tails = [
        (c, j, h)
        for c in (0, 1)
        for j, h in enumerate(
            tail_hashes(hasher.before(c), tokens[c * CHUNK : (c + 1) * CHUNK - BLOCK], BLOCK)
        )
    ][: PER + 1]
    for c, j, h in tails[:PER]:
        log.tracker.remember_tail(request, c, CHUNK, j, BLOCK, h)
    held = fold(log.step(*(("stored", "l1", log.key(h)) for _, _, h in tails[:PER])))
    assert len(held) == PER and log.tracker.counts["retracted_chunks"] == 0
    c, j, h = tails[PER]
    log.tracker.remember_tail(request, c, CHUNK, j, BLOCK, h)  # the oldest tail is forgotten
    out = log.step()
    assert removed_blocks(out, "CPU") == [published(request)[0]]
    assert log.tracker.counts["retracted_chunks"] == 1


def test_the_chunk_is_retracted_whole_when_forgotten_after_superseding_its_tails(chat: Any) -> None:
    """Its tails' blocks were spared while the chunk held them; forgetting it names them too."""
    log = ScriptedLog(kv_events_chunks=2)
    tails, chunk = remember_chat(log, chat)
    held = fold(log.step(*(("stored", "l1", t) for t in tails), ("stored", "l1", chunk)))
    held = fold(log.step(*(("removed", "l1", t) for t in tails)), held)
    assert len(held) == PER
    other = vllm_request(list(range(6000, 6000 + 2 * CHUNK + 1)))
    for c, h in enumerate(chunk_hashes(other.prompt_token_ids, CHUNK)):
        log.tracker.remember(other, c, CHUNK, h)  # 32 more blocks: the first request's are forgotten
    assert fold(log.step(), held) == set()


def test_an_object_stored_anew_keeps_what_the_tiers_reported(chat: Any) -> None:
    """Planning a store of an object already followed (the same blocks) must not forget that a
    tier holds it: its later removal is still published."""
    log = ScriptedLog()
    request, _, chunk_hash = chat
    log.tracker.remember(request, 1, CHUNK, chunk_hash)
    chunk = log.key(chunk_hash)
    held = fold(log.step(("stored", "disk", chunk)))
    assert not log.tracker.busy()
    log.tracker.remember(request, 1, CHUNK, chunk_hash)
    assert log.tracker.busy()
    held = fold(log.step(("stored", "l1", chunk)), held)  # (the disk's copy stays as it was)
    assert not log.tracker.busy()
    out = log.step(("removed", "disk", chunk))
    assert removed_blocks(out, "DISK") == published(request)[PER : 2 * PER]
    assert fold(out, held) == {("CPU", h) for h in published(request)[PER : 2 * PER]}


def test_an_object_holds_the_engine_until_each_local_tier_the_server_names_reported_it(chat: Any) -> None:
    log = ScriptedLog()
    log.local_tiers = ["l1", "disk"]
    request, _tails, chunk = chat
    log.tracker.remember(request, 1, CHUNK, chunk)
    log.step(("stored", "l1", log.key(chunk)))
    assert log.tracker.busy()  # the disk's copy is still to come: keep stepping to publish it
    log.step(("stored", "disk", log.key(chunk)))
    assert not log.tracker.busy()
    # Stored again once both reported it: nothing new will come, so it holds nothing.
    log.tracker.remember(request, 1, CHUNK, chunk)
    assert not log.tracker.busy()


def test_a_server_that_names_no_local_tiers_confirms_an_object_at_its_first_report(chat: Any) -> None:
    log = ScriptedLog()  # a server from before EventsReply.local_tiers
    request, _tails, chunk = chat
    log.tracker.remember(request, 1, CHUNK, chunk)
    log.step(("stored", "l1", log.key(chunk)))
    assert not log.tracker.busy()
