"""The scheduler half's lookups (:class:`SchedulerLookups`): how many tokens beyond the engine's
own the cache can supply for a request (``get_num_new_matched_tokens``), never waiting on the
server: a lookup of the prompt's full chunks, then of the tail blocks of the chunk after the hit
(:mod:`tiercache.connector.tails`), each advanced step by step (its ticket polled with a backoff
while the server promotes or waits for another engine's store), and the restorable prefix of what
they found. See :mod:`tiercache.connector.scheduler`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tiercache.client.client import Client, LookupResult
from tiercache.connector.scheduler_core import (
    LookupState,
    SchedulerCore,
    _extra_keys,
    _Probe,
    _Request,
    _TailLookup,
)
from tiercache.connector.tails import askable_blocks
from tiercache.errors import TierCacheError
from tiercache.keys import ObjectKey, tail_hashes
from tiercache.keys.tenant import tenant_id
from tiercache.wire import protocol as p

log = logging.getLogger(__name__)

#: Backoff between polls of a ticket the server reports pending (a promotion, or a wait for another
#: engine's stores): the first poll soon, then doubling up to the cap.
_FIRST_POLL_DELAY_S = 0.001
_MAX_POLL_DELAY_S = 0.02


class SchedulerLookups(SchedulerCore):
    """Lookups, on the fields of :class:`~tiercache.connector.scheduler_core.SchedulerCore` (module
    docstring); abstract: :class:`~tiercache.connector.scheduler.SchedulerHalf` is the class to build."""

    # -- lookups -------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the cache can supply (``None``: not known yet)."""
        st = self._reqs.get(request.request_id)
        if st is None:
            prompt = request.prompt_token_ids
            extra = _extra_keys(request)
            st = _Request(
                request.request_id,
                list(prompt) if prompt is not None else [],
                extra,
                tenant_id(extra.cache_salt),
            )
            self._reqs[request.request_id] = st
        st.local_tokens = num_computed_tokens
        st.request = request
        if st.load_failed:
            # vLLM retries a request whose asynchronous load failed from its first token: compute it.
            return 0, False
        client = self._client()
        layout = self.layout
        if client is None or layout is None or not st.prompt:
            self._settle_miss(st)
            return 0, False
        chunk = layout.chunk_size
        limit = (len(st.prompt) - 1) // chunk  # always leave at least one token to compute
        sent = False
        if st.state is LookupState.NOT_SENT and limit * chunk <= num_computed_tokens:
            # The engine has every full chunk we could offer; what it has was stored when computed.
            # Not settled: should vLLM evict some of those blocks while the request waits (for its
            # tail's lookup, or for free blocks), the next ask sends the lookup, or the engine would
            # compute what the cache holds (measured: 1,280 tokens of a restart).
            if st.saved_upto < 0:
                st.saved_upto = num_computed_tokens // chunk
            if not self._tail_block:
                return 0, False
        elif st.state is LookupState.NOT_SENT:
            try:
                st.probe.pending_id = client.lookup_async(
                    st.hashes(chunk)[:limit],
                    self._refs,
                    prefetch=self._loads_enabled,  # a producer asks only how much is stored already
                    max_chunks=limit,
                    inflight_wait_s=self._settings.inflight_wait_s if self._loads_enabled else 0.0,
                    tenant=st.tenant,
                )
            except TierCacheError as exc:
                self.link.failed("lookup", exc)
                self._settle_miss(st)
                return 0, False
            st.state, st.probe.sent_at = LookupState.WAITING_REPLY, time.monotonic()
            st.probe.sent_step, st.probe.timed = self._step, False  # (again after a preemption)
            st.probe.promised = 0
            sent = True
            st.query_chunks, st.probe.per_tier = limit, {}
        tails = bool(self._tail_block and self._loads_enabled)
        if st.state is LookupState.WAITING_REPLY and not self._collect(client, st, self._lookup_wait(sent)):
            if tails and st.tail.state is LookupState.NOT_SENT and st.probe.promised:
                # The server is promoting the chunks: their tail's lookup (and its promotion) runs
                # beside theirs, at the hit the pending reply promised, instead of after them.
                self._tail_step(client, st, num_computed_tokens, hit_chunks=st.probe.promised)
                st.tail.early = True
            return None, False  # "not known yet": vLLM skips the request this step and asks again
        if tails and st.tail.early and st.tail.chunk != self._tail_chunk(st.hit_chunks, num_computed_tokens):
            # Asked early at a hit the promotion did not keep (or the engine's own hit moved past):
            # ask again where the hit ends now, as if it had not been asked early.
            self._drop_tail(st)
            st.tail = _TailLookup(saved=st.tail.saved)
        if tails and not self._tail_step(client, st, num_computed_tokens):
            return None, False
        self._record_wait(st.probe)
        hit_tokens = self._hit_tokens(st, num_computed_tokens)
        if hit_tokens <= num_computed_tokens:
            self._drop_ticket(st)
            return 0, False
        # True: vLLM allocates the blocks, parks the request in WAITING_FOR_REMOTE_KVS and waits for
        # the workers' finished_recving (see update_state_after_alloc, update_connector_output).
        return hit_tokens - num_computed_tokens, self._async_loads

    def _lookup_wait(self, sent: bool) -> float:
        """How long to wait for the reply of a lookup just ``sent``: it usually comes within a
        millisecond, and waiting that long lets vLLM schedule the request in this step instead of
        the next. The waits of one step share ``lookup_wait_s``, so a slow server costs a step at
        most that, however many requests arrive in it."""
        if not sent or self._lookup_wait_left <= 0:
            return 0.0
        return self._lookup_wait_left

    def _hit_tokens(self, st: _Request, num_computed_tokens: int) -> int:
        """Where the hit ends: after the full chunks found, or after the tail blocks found in the
        chunk that follows what the engine and the cache hold together."""
        assert self.layout is not None
        chunk = self.layout.chunk_size
        full = st.hit_chunks * chunk
        if not st.tail.blocks or st.tail.chunk * chunk > max(full, num_computed_tokens):
            return full  # (the tail does not join on: vLLM's own hit changed since it was asked)
        return st.tail.chunk * chunk + st.tail.blocks * self._tail_block

    def _tail_chunk(self, hit_chunks: int, num_computed_tokens: int) -> int:
        """The chunk whose blocks a tail lookup asks for: the one after what the engine and the
        cache hold together."""
        assert self.layout is not None
        return max(hit_chunks, num_computed_tokens // self.layout.chunk_size)

    def _tail_step(
        self, client: Client, st: _Request, num_computed_tokens: int, hit_chunks: int | None = None
    ) -> bool:
        """Ask for the blocks of the chunk after the full hit (once; ``hit_chunks``: the hit the
        chunks' lookup promised, before it is final), or collect the reply; True once
        ``st.tail.blocks`` is final."""
        if st.tail.state is LookupState.DONE:
            return True
        sent = False
        if st.tail.state is LookupState.NOT_SENT:
            assert self.layout is not None
            chunk, block = self.layout.chunk_size, self._tail_block
            at = self._tail_chunk(st.hit_chunks if hit_chunks is None else hit_chunks, num_computed_tokens)
            asked = askable_blocks(len(st.prompt), at, chunk, block)
            if asked == 0 or at * chunk + asked * block <= num_computed_tokens:
                st.tail.state = LookupState.DONE
                return True
            st.hashes(chunk)  # the chain up to ``at`` (the hasher has consumed every full chunk)
            assert st.hasher is not None
            st.tail.hashes = tail_hashes(
                st.hasher.before(at), st.prompt[at * chunk : at * chunk + asked * block], block
            )
            try:
                st.tail.probe.pending_id = client.lookup_async(
                    st.tail.hashes,
                    self._refs,
                    max_chunks=asked,
                    inflight_wait_s=self._settings.inflight_wait_s,
                    tenant=st.tenant,
                    kind=p.LookupKind.TAIL,
                )
            except TierCacheError as exc:
                self.link.failed("lookup", exc)
                st.tail.state = LookupState.DONE
                return True
            st.tail.state, st.tail.chunk, st.tail.probe.sent_at = (
                LookupState.WAITING_REPLY,
                at,
                time.monotonic(),
            )
            sent = True
        return self._collect_tail(client, st, self._lookup_wait(sent))

    def _advance(self, client: Client, probe: _Probe, wait_s: float) -> LookupResult | None:
        """One step of a lookup in flight, waiting up to ``wait_s`` for a reply: the reply once it is
        final, ``None`` while it is not. A ticket the server reports pending (a promotion, or a
        wait for another engine's store) is polled again after a backoff; once it is too late the
        pending reply is returned (the caller gives up). Raises :class:`TierCacheError`."""
        if probe.pending_id == 0:  # a pending ticket between polls (see below)
            if time.monotonic() < probe.poll_after:
                return None
            probe.pending_id, probe.polled_at = client.poll_ticket_async(probe.ticket), time.monotonic()
            # The server answers a poll at once: waited for like a lookup just sent, or its reply
            # would be read a step later, and every promotion would hold the request back two steps.
            wait_s = max(wait_s, self._lookup_wait(True))
        # The client raises ServerUnavailableError once the reply is timeout_s late.
        began = time.monotonic()
        result: LookupResult | None = client.poll(probe.pending_id, wait_s)
        if wait_s:
            self._lookup_wait_left -= time.monotonic() - began
        if result is None:
            return None
        if result.ticket:
            probe.ticket = result.ticket
        if result.state is p.TicketStateName.PENDING and not probe.promised:
            probe.promised = result.chunks
        if result.per_tier:  # kept: ticket polls do not repeat them, and a pending reply returns None
            probe.per_tier = dict(result.per_tier)
        if result.state is not p.TicketStateName.PENDING:
            # Taken from this very reply: the client says hello again by itself when the server
            # restarts, so whatever it holds at connect may name an arena these slots are not in.
            probe.arena = result.arena
            return result
        # A promotion gets timeout_s, like any round trip; a wait for another engine's store is the
        # server's to bound (inflight_wait_s), so it gets that on top.
        probe.awaited = probe.awaited or result.awaiting > 0
        bound = self._settings.timeout_s + (self._settings.inflight_wait_s if probe.awaited else 0.0)
        if time.monotonic() - probe.sent_at > bound:
            return result
        # Poll again after a backoff (1 ms, doubling to 20 ms): vLLM asks every step, and an
        # in-flight wait can last seconds (a poll per step was measured at ~900/s).
        probe.poll_delay = (
            min(2 * probe.poll_delay, _MAX_POLL_DELAY_S) if probe.poll_delay else _FIRST_POLL_DELAY_S
        )
        # Counted from when the question was sent, not from when its reply was read: a reply that
        # came after the step's lookup_wait_s is read a step later, when the backoff has passed
        # already, and the ticket is polled at once instead of a step later still.
        probe.poll_after = max(probe.sent_at, probe.polled_at) + probe.poll_delay
        probe.pending_id = 0
        if time.monotonic() >= probe.poll_after:
            return self._advance(client, probe, 0.0)  # (sends the poll: its poll_after is later)
        return None

    def _collect_tail(self, client: Client, st: _Request, wait_s: float) -> bool:
        """Advance the tail lookup as :meth:`_collect` does the chunks'; True once it is settled."""
        try:
            result = self._advance(client, st.tail.probe, wait_s)
        except TierCacheError as exc:
            self.link.failed("lookup", exc)
            st.tail.probe.ticket = 0  # a server that failed us holds no usable pins for us
            self._drop_tail(st)
            st.tail.state = LookupState.DONE
            return True
        if result is None:
            return False
        st.tail.state = LookupState.DONE
        # (Still pending here means too late: given up, as the chunks' lookup does.)
        if result.state is not p.TicketStateName.READY or not result.ready_chunks or self.layout is None:
            self._drop_tail(st)
            return True
        # One object holds the blocks found, at its first positions: a tail, or the chunk itself
        # (found through the server's block index). Every group's object of it is pinned (a
        # sliding group's too: the tail is the newest part of its window), all of one size in
        # blocks, holding at least the blocks the reply counts.
        blocks = min(result.blocks, len(st.tail.hashes))
        by_group = {}
        pinned = result.held
        for (group, prefix_hash), offset, nbytes, digest in zip(
            ObjectKey.groups_and_hashes(pinned.keys), pinned.offsets, pinned.nbytes, pinned.digests
        ):
            by_group[group] = (prefix_hash, nbytes)
            st.tail.slots[group] = (offset, nbytes, digest)
        targets = {h for h, _ in by_group.values()}
        sizes = set()
        for g in self.layout.groups:
            held = by_group.get(g.object_group)
            per_block = len(g.layer_names) * g.page_bytes
            if held is None or not per_block or held[1] % per_block:
                sizes.add(-1)
            else:
                sizes.add(held[1] // per_block)
        object_blocks = sizes.pop() if len(sizes) == 1 else -1
        if len(targets) != 1 or not blocks <= object_blocks <= self.layout.chunk_size // self._tail_block:
            blocks = 0
        st.tail.blocks = blocks
        st.tail.saved = (st.tail.chunk, blocks)  # the server holds these: never stored again
        if blocks == 0:
            self._drop_tail(st)
        else:
            st.tail.target, st.tail.object_blocks = targets.pop(), object_blocks
            self.stats.add("hit_tokens", blocks * self._tail_block)
        return True

    def _collect(self, client: Client, st: _Request, wait_s: float = 0.0) -> bool:
        """Advance an outstanding lookup, waiting up to ``wait_s`` for its first reply; True once
        ``hit_chunks`` is final."""
        try:
            result = self._advance(client, st.probe, wait_s)
        except TierCacheError as exc:
            self.link.failed("lookup", exc)
            st.probe.ticket = 0  # a server that failed us holds no usable pins for us
            self._settle_miss(st)
            self._record_lookup(st)
            return True
        if result is None:
            return False
        if result.state is p.TicketStateName.PENDING:  # still pending, too late
            what = "wait for another engine's store" if st.probe.awaited else "promotion"
            log.info("tiercache: %s for %s too slow; computing instead", what, st.req_id)
            self._drop_ticket(st)
            self._settle_miss(st)
            self._record_lookup(st)
            return True
        if st.saved_upto < 0:
            st.saved_upto = result.chunks if result.chunks else 0
        st.state = LookupState.DONE
        if result.state is not p.TicketStateName.READY or not result.ready_chunks:
            self._drop_ticket(st)
            st.hit_chunks = 0
            self._record_lookup(st)
            return True
        index = {h: i for i, h in enumerate(st.hashes(self.layout.chunk_size))} if self.layout else {}
        slots: dict[int, dict[int, tuple[int, int, int]]] = {}
        held = result.held
        for at, (group, prefix_hash) in zip(
            zip(held.offsets, held.nbytes, held.digests), ObjectKey.groups_and_hashes(held.keys)
        ):
            i = index.get(prefix_hash)
            if i is not None:
                slots.setdefault(i, {})[group] = at
        hit = self._restorable(slots, result.ready_chunks)
        st.hit_chunks, st.slots = hit, slots
        if hit == 0:
            self._drop_ticket(st)
        self._record_lookup(st)
        return True

    def _record_wait(self, probe: _Probe) -> None:
        """Time a sent lookup once, when the scheduler can first answer vLLM about its request: the
        seconds since it was sent, and whether vLLM held the request back a step or more meanwhile
        (a promotion from disk or S3, a reply later than ``lookup_wait_s``, the tail's lookup)."""
        if probe.timed or not probe.sent_at:
            return
        probe.timed = True
        self.stats.add("lookup_durations", time.monotonic() - probe.sent_at)
        if self._step != probe.sent_step:
            self.stats.add("lookups_deferred")

    def _record_lookup(self, st: _Request) -> None:
        """Count a settled lookup: what it asked about and what the cache can supply."""
        chunk = self.layout.chunk_size if self.layout is not None else 0
        self.stats.add("lookups")
        self.stats.add("query_tokens", st.query_chunks * chunk)
        if st.hit_chunks:
            self.stats.add("hit_chunks", st.hit_chunks)
            self.stats.add("hit_tokens", st.hit_chunks * chunk)
            self.stats.add_tiers(st.probe.per_tier)

    def _restorable(self, slots: dict[int, dict[int, tuple[int, int, int]]], ready: int) -> int:
        """The longest boundary ``<= ready`` whose needed objects (every chunk of a full-attention
        group, the trailing window chunks of a sliding one) are all pinned for us."""
        layout = self.layout
        if layout is None:
            return 0
        for boundary in range(ready, 0, -1):
            if all(
                g.object_group in slots.get(c, {})
                for g in layout.groups
                for c in g.needed_chunks(boundary, layout.chunk_size)
            ):
                return boundary
        return 0
