"""The scheduler half: runs in vLLM's scheduler (EngineCore) process, on the engine loop.

Nothing here may wait on the server: lookups go out with :meth:`Client.lookup_async` and are
collected with :meth:`Client.poll`; while one is outstanding ``get_num_new_matched_tokens`` answers
``None`` ("not known yet, ask again next step"). The short loop-side calls (release of a ticket,
registration at start-up) are round trips bounded by ``timeout_s``; any failure makes the link go
down, and while it is down every request is a miss.

Per request this half hashes the prompt's full chunks (``PrefixHasher``, seeded with the cache salt
and LoRA name), looks them up, keeps the lookup ticket (which pins the hit objects in the L1 arena)
until the workers have copied them, and tells the workers which newly computed prompt chunks to
store.

Loads are synchronous for one KV-cache group (the ticket is released once the step carrying the
load ran; failed chunks come back as invalid block ids). With several KV-cache groups, or recurrent
state, vLLM cannot take block-level failures, so hits are answered ``(n, True)``: vLLM parks the
request in ``WAITING_FOR_REMOTE_KVS`` until the workers report it in ``finished_recving`` (and in
``failed_recving`` if the load failed; vLLM then recomputes it from token 0 and this half answers
that retry with no hit). The ticket is kept until that report. Requests for which a store was scheduled are held (``request_finished`` returns True) until
the workers report them in ``finished_sending``.

With vLLM's ``--kv-events-config`` on, it also publishes which tiers hold the chunks and tails it
stored, as vLLM KV events (:mod:`tiercache.connector.events`; ``take_events``).

Recurrent (Mamba/GDN, ``mamba_cache_mode="align"``) groups: vLLM's block table for them is
position-indexed but sparse (null 0s) and entries move, so the block holding the state at a chunk
boundary is never resolved positionally. vLLM hands it over each step in
``scheduler_output.kv_connector_block_state.boundary_state_offloads`` (``(group, block, tokens)``
for the states that step computes); the state after chunk ``c`` is stored with chunk ``c``'s save.
On a hit of ``b`` chunks, vLLM assigns the state block at table position ``b * chunk / block - 1``
(as for its own prefix-cache hits), and the worker copies chunk ``b - 1``'s state object there.
"""

from __future__ import annotations

import logging
from typing import Any

from tiercache.connector.blockmap import blocks_to_load
from tiercache.connector.metadata import ChunkLoad, RequestLoad, TierCacheMetadata
from tiercache.connector.scheduler_core import LookupState, _Request
from tiercache.connector.scheduler_saves import SchedulerSaves
from tiercache.connector.stats import TierCacheConnectorStats
from tiercache.connector.tails import tail_blocks
from tiercache.errors import TierCacheError

log = logging.getLogger(__name__)


class SchedulerHalf(SchedulerSaves):
    """See the module docstring. Every method runs on the engine loop thread.

    ``link`` builds the connection to the server (a test passes a fake one); it is started here, and
    on every (re)connect the engine's layout is derived, checked and registered (:meth:`use_layout`).

    ``loads`` / ``stores`` follow vLLM's ``kv_role``: a producer (prefill engine) stores and never
    loads: its lookups only learn what the server already has, so nothing is stored twice; a
    consumer (decode engine) loads and never stores; ``kv_both`` does both.

    One object with one set of fields, in layers:
    :class:`~tiercache.connector.scheduler_core.SchedulerCore` (the fields, the layout, the request
    state) → :class:`~tiercache.connector.scheduler_lookups.SchedulerLookups` (lookups) →
    :class:`~tiercache.connector.scheduler_saves.SchedulerSaves` (saves planning) → this class
    (loads, the step's metadata, step results and request end).
    """

    # -- allocation and metadata ---------------------------------------------------------------
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks for ``num_external_tokens`` tokens from the cache:
        plan their load (sent with the next metadata), or drop the ticket when there are none."""
        st = self._reqs.get(request.request_id)
        if st is None or self.layout is None:
            return
        if num_external_tokens <= 0:
            self._drop_ticket(st)
            return
        # One block list per KV-cache group, each in that group's own block size (their lengths
        # differ when the block sizes do, e.g. Gemma 4: ``([1, 2], [3, 4, 5, 6])``).
        block_ids = [list(ids) for ids in blocks.get_block_ids()]
        start, end = st.local_tokens, st.local_tokens + num_external_tokens
        chunks, complete = self._chunk_loads(st, block_ids, start, end)
        self._add_load(st, chunks, complete)
        st.saved_upto = max(st.saved_upto, end // self.layout.chunk_size)

    def _chunk_loads(
        self, st: _Request, block_ids: list[list[int]], start: int, end: int
    ) -> tuple[list[ChunkLoad], bool]:
        """The chunk loads of the tokens ``start:end`` of ``st`` into ``block_ids``, and whether
        they place every chunk (``complete``)."""
        layout = self.layout
        assert layout is not None
        hashes = st.hashes(layout.chunk_size)
        sizes = layout.kv_group_block_sizes()
        recurrent = layout.recurrent_kv_groups()
        # A sliding-window group's blocks before the window are vLLM's null block (0): the worker
        # skips those positions (and the group, for chunks wholly outside the window). A chunk
        # whose blocks are not all allocated ends the list: load less, never garbage.
        chunk = layout.chunk_size
        # Whole chunks up to the full hit's end; the tail's blocks (if the hit ends in one) after.
        full_end = min(end, st.hit_chunks * chunk) if st.tail.blocks else end
        planned = (
            blocks_to_load(block_ids, sizes, chunk, start, full_end, skip=recurrent)
            if full_end > start
            else []
        )
        chunks = [
            ChunkLoad(
                hashes[cb.chunk],
                [list(p) for p in cb.positions],
                [list(i) for i in cb.block_ids],
                slots=[(g, *at) for g, at in st.slots.get(cb.chunk, {}).items()],
            )
            for cb in planned
        ]
        complete = full_end <= start or (bool(planned) and planned[-1].chunk == -(-full_end // chunk) - 1)
        if end > full_end:
            tail, whole = self._tail_load(st, block_ids, start, end)
            if tail is not None:
                chunks.append(tail)
            complete = complete and whole
        if recurrent and complete:
            # The state at the boundary goes where vLLM put it for a hit of ``end`` tokens; a null
            # (0) here makes the worker fail the load, so vLLM recomputes.
            last = chunks[-1]
            last.state = True
            for kv in recurrent:
                at = end // sizes[kv] - 1
                last.block_ids[kv] = [block_ids[kv][at] if at < len(block_ids[kv]) else 0]
                last.positions[kv] = [0]
        return chunks, complete

    def _tail_load(
        self, st: _Request, block_ids: list[list[int]], start: int, end: int
    ) -> tuple[ChunkLoad | None, bool]:
        """The load of the tail blocks found (``st.tail``) among the tokens ``start:end`` (``None``
        when none is allocated), and whether every one of them is placed."""
        assert self.layout is not None
        chunk = self.layout.chunk_size
        base = st.tail.chunk * chunk
        first, upto = -(-(max(start, base) - base) // self._tail_block), (end - base) // self._tail_block
        tails = tail_blocks(
            block_ids,
            st.tail.chunk,
            chunk,
            self._tail_block,
            st.tail.hashes,
            first,
            upto,
            store=False,
            sliding=self.layout.kv_group_windows().keys(),
        )
        load = None
        if tails:  # one object holds them all, block j at its position j
            load = ChunkLoad(
                st.tail.target,
                [[t.j for t in tails if t.block_ids[g]] for g in range(len(block_ids))],
                [[t.block_ids[g][0] for t in tails if t.block_ids[g]] for g in range(len(block_ids))],
                blocks=st.tail.object_blocks,
                slots=[(g, *at) for g, at in st.tail.slots.items()],
            )
        return load, len(tails) == upto - first

    def _add_load(self, st: _Request, chunks: list[ChunkLoad], complete: bool) -> None:
        """Send ``chunks`` to the workers with the next metadata (:class:`RequestLoad`):
        asynchronous for layouts vLLM parks the request for, synchronous otherwise."""
        # Where the ticket pinned them, so the workers need not pin again: the lookups' send is
        # before any of their leases started (RequestLoad.leased_at).
        probes = [pr for pr in (st.probe, st.tail.probe) if pr.ticket and pr.sent_at]
        arenas = {pr.arena for pr in probes}
        arena = arenas.pop() if len(arenas) == 1 else ""  # two servers' slots: the workers pin by key
        named = bool(probes and arena and chunks and all(c.slots for c in chunks))
        leased_at = min(pr.sent_at for pr in probes) if named else 0.0
        if self._async_loads:
            # vLLM counts all ``num_external_tokens`` as computed once the load is reported: a load
            # that cannot place every chunk is reported failed by the workers (``complete``).
            self._loads.append(
                RequestLoad(
                    st.req_id, chunks, asynchronous=True, complete=complete, leased_at=leased_at, arena=arena
                )
            )
            st.loading, st.loaded_from_slots = True, bool(leased_at)
            # the ticket stays until the workers report the load (update_connector_output)
            # A request loading anew was preempted (or is new): its earlier stores were flushed at
            # the preemption and the workers forget them on this load. Finished while loading, it
            # must not be held for finished_sending too: vLLM frees it on finished_recving, and a
            # second report for a freed request fails its assertion.
            st.saves_scheduled = 0
        else:
            self._loads.append(RequestLoad(st.req_id, chunks, leased_at=leased_at, arena=arena))
            self._drop_ticket(st, read=bool(leased_at))  # released once the step carrying these loads has run

    def build_connector_meta(self, scheduler_output: Any) -> TierCacheMetadata:
        if self._releases_held:  # no lookup of this step took the last step's releases along
            self._releases_held = False
            client = self.link.client()
            if client is not None:
                client.flush_releases()
        self._lookup_wait_left = self._settings.lookup_wait_s  # a new step: a new budget (_lookup_wait)
        self._step += 1
        self._unfinished_steps.append(self._step)
        meta = TierCacheMetadata(step=self._step, loads=self._loads, saves=self._end_saves)
        self._loads, self._end_saves = [], []
        # Sliding-window groups free blocks that fall out of the window while the request runs, and
        # vLLM may hand them to another request in the very next step: with such groups every store
        # queued in the previous step is finished before the next forward pass can rewrite a block.
        meta.flush = bool(getattr(scheduler_output, "preempted_req_ids", None)) or self._saves_last_step
        self._saves_last_step = False
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            st = self._reqs.get(rid)
            if st is not None:  # it will be matched again when it is rescheduled
                self._drop_ticket(st)
                st.state, st.hit_chunks, st.load_failed = LookupState.NOT_SENT, 0, False
                st.tail.state = LookupState.NOT_SENT
                st.states.clear()  # its blocks are freed: offers made before are void
        self._take_boundary_states(scheduler_output)
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = [list(ids) for ids in new.block_ids]
            self._plan_saves(st, new.num_computed_tokens, num_scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = [list(ids) for ids in new_ids] if new_ids is not None else st.block_ids
            elif new_ids is not None:
                for g, ids in enumerate(new_ids):
                    st.block_ids[g].extend(ids)
            self._plan_saves(st, cached.num_computed_tokens[i], num_scheduled.get(rid, 0), meta)
        # Recurrent state blocks are freed as the request moves on (the block holding the state
        # after step N is freed when step N+2 is scheduled): the same early flush protects them.
        if meta.saves and self.layout is not None and (self.layout.has_sliding or self.layout.has_recurrent):
            self._saves_last_step = True
        self._collect_orphans()
        return meta

    def _collect_orphans(self) -> None:
        client = self.link.client()
        if client is None or not self._orphans:
            return
        keep = []
        for req_id in self._orphans:
            try:
                result = client.poll(req_id)
            except TierCacheError:
                continue
            if result is None:
                keep.append(req_id)
            elif result.ticket:
                self._release_at.setdefault(self._step + 1, []).append((result.ticket, False))
        self._orphans = keep

    # -- step results and request end ---------------------------------------------------------
    def update_connector_output(self, connector_output: Any) -> None:
        """A step has run: release the tickets whose loads it carried, and those of the asynchronous
        loads the workers reported (``finished_recving``; failed ones are also in ``failed_recving``)."""
        tickets: list[tuple[int, bool]] = []
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        for rid in getattr(connector_output, "finished_recving", None) or ():
            st = self._reqs.get(rid)
            if st is None or not st.loading:
                continue  # finished while loading: request_finished already scheduled the release
            st.loading = False
            read = st.loaded_from_slots and rid not in failed
            tickets.extend(
                (t, read) for t in (st.probe.ticket, st.tail.probe.ticket) if t
            )  # every worker is done copying
            st.probe.ticket, st.slots, st.hit_chunks = 0, {}, 0
            st.tail.probe.ticket, st.tail.blocks, st.tail.slots = 0, 0, {}
            # On a failure vLLM frees the blocks and schedules the request again from its first
            # token (Scheduler._handle_failed_recving): that retry computes instead of loading.
            st.load_failed = rid in failed
        if self._unfinished_steps:
            done = self._unfinished_steps.popleft()
            for step in [s for s in self._release_at if s <= done]:
                tickets.extend(self._release_at.pop(step))
        if not tickets:
            return
        client = self.link.client()
        if client is None:
            return  # the server forgot them (restart) or leases expire by themselves
        for ticket, read in tickets:
            # Not waited for: the engine loop learns nothing from the reply (the workers judged
            # their copies by time), and a release that is lost ends with its leases' TTL. Held
            # back to ride the next step's first lookup; build_connector_meta sends what is left.
            client.release_ticket_later(ticket, read=read)
        self._releases_held = True

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks (True) iff stores were scheduled for the request: the workers then
        report it in ``finished_sending`` once those stores are done."""
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        if st.state is LookupState.WAITING_REPLY and st.probe.pending_id:
            self._orphans.append(st.probe.pending_id)
        if st.tail.state is LookupState.WAITING_REPLY and st.tail.probe.pending_id:
            self._orphans.append(st.tail.probe.pending_id)
        if self._tail_block:
            self._plan_end_saves(st, request)
        # Also while its asynchronous load is in flight (vLLM holds the blocks until the workers
        # report it): released after the next step, which runs after the step carrying the load.
        self._drop_ticket(st)
        return st.saves_scheduled > 0, None

    def take_stats(self) -> TierCacheConnectorStats | None:
        """Lookups since the last call, and server outages this half noticed."""
        outages = self.link.outages
        if outages != self._outages_counted:
            self.stats.add("server_unavailable", outages - self._outages_counted)
            self._outages_counted = outages
        return self.stats.take()

    def has_pending_events(self) -> bool:
        """Whether stored chunks still wait for their first event (vLLM keeps stepping meanwhile)."""
        return self.events.busy()

    def take_events(self) -> list[Any]:
        """KV events (vLLM's ``BlockStored`` / ``BlockRemoved``) for the tiers that gained or lost
        chunks and tails this engine stored, since the last call (see :mod:`tiercache.connector.events`)."""
        return self.events.take(self._client())

    def shutdown(self) -> None:
        self.link.close()
        if self.feed is not None:
            self.feed.close()
