"""The worker half's saves (:class:`WorkerSaves`): a step's stores queued to one background thread
(``tiercache-connector-save``) that reserves arena slots, copies the pages of the chunks' blocks in
and commits, and the waits for them (see :mod:`tiercache.connector.worker`).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from tiercache.client.affinity import spread_current_thread
from tiercache.client.transfer import Store
from tiercache.connector.copy import PageCopyEngine
from tiercache.connector.layout import GroupLayout
from tiercache.connector.metadata import ChunkSave, TierCacheMetadata
from tiercache.connector.worker_loads import WorkerLoads
from tiercache.errors import TierCacheError
from tiercache.keys import ObjectKey
from tiercache.keys.digest import Digest

log = logging.getLogger(__name__)

_STOP = object()
#: A store that ends this many seconds after its step queued it is logged (at most once a minute):
#: a lookup waiting for it as a store in flight gives up after its ``inflight_wait_s``.
SLOW_STORE_S = 10.0
_SLOW_LOG_EVERY_S = 60.0


@dataclass(eq=False)
class _Reservation:
    """A save batch's reservation (``store``: its slots, in the order of ``sources``, the group and
    save of each object); ``skipped``: nothing was reserved although the batch had objects (server
    down, L1 full); neither: nothing in the batch to store."""

    store: Store | None = None
    sources: list[tuple[GroupLayout, ChunkSave]] = field(default_factory=list)
    skipped: bool = False


class WorkerSaves(WorkerLoads):
    """Saves, on top of :class:`~tiercache.connector.worker_loads.WorkerLoads` (a step's saves
    finish its synchronous load first); abstract: :class:`~tiercache.connector.worker.WorkerHalf`
    is the class to build."""

    # -- saves ---------------------------------------------------------------------------------
    def wait_for_save(self, meta: TierCacheMetadata | None) -> None:
        """Finish this step's synchronous load (the forward pass is done), then queue this step's
        stores; the background thread does them."""
        self._finish_loads(wait=False)
        if meta is None or not meta.saves:
            return
        by_req: dict[str, int] = defaultdict(int)
        for save in meta.saves:
            by_req[save.req_id] += 1
        with self._lock:
            for rid, n in by_req.items():
                self._pending[rid] += n
                self._with_saves.add(rid)
        # What the save thread's copies wait for (CUDA: an event after this forward pass).
        ready = self._copy.save_point() if self._copy is not None else None
        batch = list(meta.saves)
        # A producer reserves here, on the engine thread, so it does not wait behind the copies
        # still queued before this batch: one round trip, bounded by timeout_s.
        early = self._reserve(batch) if self._reserve_before_return else None
        self._queue.put((ready, batch, early, time.monotonic()))

    def _wait_idle(self, req_id: str | None) -> None:
        with self._idle:
            while self._pending.get(req_id, 0) if req_id is not None else any(self._pending.values()):
                self._idle.wait(1.0)

    def _save_loop(self) -> None:
        spread_current_thread()
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            ready, batch, early, queued = item
            started = time.perf_counter()
            behind = time.monotonic() - queued  # waiting for the stores queued before it
            saved, skipped, stored_bytes = self.stats["saved_chunks"], self.stats["save_skipped"], 0
            try:
                stored_bytes = self._save_batch(batch, ready, early)
            except Exception as exc:  # a failed store is a skipped store, never a crash
                log.warning("tiercache: storing %d chunk(s) failed: %s", len(batch), exc)
                self.stats["save_skipped"] += len(batch)
            finally:
                seconds = time.perf_counter() - started
                # This thread is the only writer of the store counters: the deltas are this batch's.
                self._record_store(
                    self.stats["saved_chunks"] - saved,
                    self.stats["save_skipped"] - skipped,
                    stored_bytes,
                    seconds,
                )
                if behind + seconds >= SLOW_STORE_S:
                    self._slow_store(len(batch), behind, seconds)
                with self._idle:
                    for save in batch:
                        self._pending[save.req_id] -= 1
                        if self._pending[save.req_id] <= 0:
                            del self._pending[save.req_id]
                    self._idle.notify_all()

    def _slow_store(self, chunks: int, behind: float, seconds: float) -> None:
        """Log a store that ended late (the first, then at most one a minute, with the count)."""
        self._slow_stores += 1
        now = time.monotonic()
        if now - self._slow_logged_at < _SLOW_LOG_EVERY_S:
            return
        log.warning(
            "tiercache: a store of %d chunk(s) ended %.1f s after its step (%.1f s queued behind "
            "earlier stores, %.1f s copying and committing; %d slow store(s) since the last such "
            "line): a lookup waiting for it as a store in flight gives up after its inflight_wait_s",
            chunks,
            behind + seconds,
            behind,
            seconds,
            self._slow_stores,
        )
        self._slow_logged_at, self._slow_stores = now, 0

    def _record_store(self, stored: int, skipped: int, nbytes: int, seconds: float) -> None:
        if stored:
            self.recorder.add("stored_chunks", stored)
            self.recorder.add("stored_bytes", nbytes)
            self.recorder.add("store_seconds", seconds)
            self.recorder.add("store_durations", seconds)
        if skipped:
            self.recorder.add("store_skipped", skipped)

    def _save_batch(
        self, batch: list[ChunkSave], ready: Any = None, early: _Reservation | None = None
    ) -> int:
        """Store a batch (reserving it first unless ``early`` holds its reservation, made on the
        engine thread by a producer, and still young enough to write into); returns the bytes
        committed (0 when skipped)."""
        reservation = early if early is not None else self._reserve(batch)
        if reservation.store is not None and not reservation.store.may_write():
            # A producer's reservation that waited behind earlier saves past its window: a copy
            # into it now could land in a slot the server gave to another object. Reserve anew.
            reservation.store.abort()
            self.stats["stale_reservations"] += 1
            reservation = self._reserve(batch)
        if reservation.skipped:
            self.stats["save_skipped"] += len(batch)
            return 0
        store, sources = reservation.store, reservation.sources
        if store is None:
            return 0  # nothing in the batch to store
        assert self._copy is not None
        copy = self._copy

        def write(i: int, target: memoryview) -> int:
            return self._save_object(copy, store, i, sources[i], ready, len(target))

        digests = store.fill(write)
        if digests is None:  # the window passed while the batch was being copied: aborted
            log.warning(
                "tiercache: a store's copies outlasted its reservation's window "
                "(--l1-reservation-ttl-s); it was dropped rather than risk writing into reused slots"
            )
            self.stats["save_skipped"] += len(batch)
            return 0
        # The shorter tails the committed chunks and tails cover (every KV group's objects of them).
        covered = [
            ObjectKey(self._fingerprints[g.object_group], g.object_group, h)
            for save in batch
            for h in save.supersedes
            for g in self._groups
            if not g.is_recurrent
        ]
        try:
            store.commit(digests, supersedes=covered)
        except TierCacheError as exc:
            self.link.failed("commit of a store", exc)
            self.stats["save_skipped"] += len(batch)
            return 0
        self.stats["saved_chunks"] += len(batch)
        return sum(s.nbytes for s in store.slots if s is not None)

    def _save_object(
        self,
        copy: PageCopyEngine,
        store: Store,
        i: int,
        source: tuple[GroupLayout, ChunkSave],
        ready: Any,
        nbytes: int,
    ) -> int:
        """Copy object ``i`` of a save batch (``source``: its group and save) into its reserved
        slot of ``store`` (``nbytes`` long), after ``ready``; returns its digest."""
        g, save = source
        n = save.blocks or g.blocks_per_chunk
        dst = copy.host(store.arena, store.slot(i).offset, nbytes)
        dst = dst.view(len(g.layer_names), n, g.page_bytes)
        ids = save.block_ids[g.kv_group]
        if len(ids) != n:
            raise ValueError(
                f"the object of KV-cache group {g.kv_group} is {n} blocks, the save has {len(ids)}"
            )
        # A tail's sliding group: its first blocks may be gone (zeros, which the tail's block
        # index entries never let a load read); never a null block anywhere else.
        zeros = next((k for k, b in enumerate(ids) if b), n) if _zeros_allowed(save, g) else 0
        if 0 in ids[zeros:]:
            raise ValueError("refusing to store the null block")
        if zeros:
            dst[:, :zeros].zero_()
        digest = Digest()
        copy.save(
            ready,
            self._pages[g.kv_group],
            torch.tensor(ids[zeros:], dtype=torch.long),
            [rows[zeros:] for rows in dst],
            digest,
            zeros,
        )
        return digest.value

    def _reserve(self, batch: list[ChunkSave]) -> _Reservation:
        """Reserve arena slots for every object of ``batch`` (one round trip). Touches no counter:
        a producer calls it on the engine thread, and the save thread counts the outcome."""
        client = self.link.client()
        if client is None or not self._groups:
            return _Reservation(skipped=bool(batch))
        items: list[tuple[ObjectKey, int]] = []
        tenants: list[bytes] = []
        sources: list[tuple[GroupLayout, ChunkSave]] = []
        for save in batch:
            for g in self._groups:
                ids = save.block_ids[g.kv_group]
                if not any(ids) or (0 in ids and not _zeros_allowed(save, g)):
                    continue  # a sliding group's blocks out of the window, or no state kept: no object
                n = save.blocks or g.blocks_per_chunk
                items.append(
                    (
                        ObjectKey(self._fingerprints[g.object_group], g.object_group, save.prefix_hash),
                        len(g.layer_names) * n * g.page_bytes,
                    )
                )
                tenants.append(save.tenant)
                sources.append((g, save))
        if not items:
            return _Reservation()
        holds = [(save.prefix_hash, save.holds) for save in batch if save.holds]
        try:
            return _Reservation(Store.reserve(client, items, tenants=tenants, holds=holds), sources)
        except TierCacheError as exc:
            if getattr(exc, "code", "") in ("tier_full", "busy"):
                log.debug("tiercache: store skipped: %s", exc)
            else:
                self.link.failed("store", exc)
            return _Reservation(skipped=True)


def _zeros_allowed(save: ChunkSave, g: GroupLayout) -> bool:
    """Whether ``save`` may hold zeros for ``g``'s null blocks: a tail's sliding group, whose first
    blocks vLLM freed before the store (:meth:`SchedulerSaves._plan_tail_saves
    <tiercache.connector.scheduler_saves.SchedulerSaves._plan_tail_saves>`)."""
    return save.blocks > 0 and g.is_sliding
