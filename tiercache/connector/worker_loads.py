"""The worker half's loads (:class:`WorkerLoads`): a step's loads from the scheduler's metadata
to the report of each request (see :mod:`tiercache.connector.worker`): where the slots come from
(the scheduler's ticket, or a pin by key), the page writes of each chunk in the layers' forward
order, the per-layer waits of the forward pass, the checks of the copies and the release.
"""

from __future__ import annotations

import logging
import time

import torch

from tiercache.client.client import Client
from tiercache.client.transfer import Load, SlotCheck
from tiercache.connector.layout import GroupLayout
from tiercache.connector.loads import PageWrite
from tiercache.connector.metadata import ChunkLoad, TierCacheMetadata
from tiercache.connector.worker_core import WorkerCore, _StepLoad
from tiercache.errors import TierCacheError
from tiercache.keys import ObjectKey
from tiercache.l1.arena import SharedArena
from tiercache.wire.protocol import Slot

log = logging.getLogger(__name__)


class WorkerLoads(WorkerCore):
    """Loads, on the fields of :class:`~tiercache.connector.worker_core.WorkerCore` (module
    docstring); abstract: :class:`~tiercache.connector.worker.WorkerHalf` is the class to build."""

    # -- loads ---------------------------------------------------------------------------------
    def start_load_kv(self, meta: TierCacheMetadata | None) -> None:
        """Pin this step's chunks by key (one round trip) and start writing them into their blocks
        (a :class:`~tiercache.connector.loads.LoadJob`); :meth:`_finish_load` reports and releases.
        A synchronous load's failed chunks put their blocks into the load errors (vLLM recomputes);
        an asynchronous load is reported done, and failed if any chunk failed (module docstring).
        Runs once per step: from ``handle_preemptions`` normally, else from vLLM's ``start_load_kv``."""
        if meta is None or not meta.loads or meta.step == self._loaded_step:
            return
        self._loaded_step = meta.step
        started = time.perf_counter()
        chunks = [chunk for load in meta.loads for chunk in load.chunks]
        owner = [i for i, load in enumerate(meta.loads) for _ in load.chunks]  # chunk → its load
        # Per chunk, the groups it loads: a sliding-window group whose blocks in the chunk are all
        # vLLM's null block (before the window) needs no object for it; a recurrent group loads only
        # the state at the hit boundary (``chunk.state``).
        wanted = [
            [g for g in self._groups if (chunk.state if g.is_recurrent else any(chunk.block_ids[g.kv_group]))]
            for chunk in chunks
        ]
        transfer, from_ticket = self._load_slots(meta, chunks, wanted)
        load = _StepLoad(meta, owner, started, transfer, ticket_slots=from_ticket)
        try:
            plan = self._plan_writes(load, chunks, wanted)
            assert self._copy is not None
            load.job = self._copy.start_load(plan, overlap=self._overlap)
            if load.checks and load.job.done():
                # The copies are done: their checks hash the slots on another thread while the
                # forward pass runs. A failed one is reported at the end of the step (a load
                # error), and vLLM drops what the step computed from it and recomputes.
                load.verdict = self._checker.submit(_failed_checks, load.checks)
        finally:
            # Also after an unexpected error (no job): a parked request nobody reports would wait
            # forever, and its pins would outlive it.
            self._loads.append(load)
            # A synchronous load feeds this very step's forward pass (which may wait for it layer
            # by layer); an asynchronous one is reported once its writes are done, maybe steps later.
            if load.job is None:
                self._finish_load(load)
            elif load.sync:
                self._sync_load = load

    def _load_slots(
        self, meta: TierCacheMetadata, chunks: list[ChunkLoad], wanted: list[list[GroupLayout]]
    ) -> tuple[Load | None, bool]:
        """The slots this step's load copies from, every object of ``wanted`` in order, and whether
        they are the scheduler's ticket's: where its lookup pinned them (no round trip), else
        pinned here by key; ``None`` when the server cannot be asked or the pin failed."""
        keys = [
            ObjectKey(self._fingerprints[g.object_group], g.object_group, chunk.prefix_hash)
            for chunk, groups in zip(chunks, wanted)
            for g in groups
        ]
        client = self.link.client()
        transfer: Load | None = None
        mapped = self._mapped_arena(client)
        ticket = self._ticket_slots(client, mapped, meta, chunks, wanted, keys)
        if ticket is not None:  # where the scheduler's ticket pinned them: no round trip
            transfer = ticket
        elif client is not None and keys:
            try:
                # The slots are offsets in the arena of the session that answered the pin.
                transfer = Load.pin(client, keys)
            except TierCacheError as exc:
                self.link.failed("pin for a load", exc)
        return transfer, ticket is not None

    def _plan_writes(
        self, load: _StepLoad, chunks: list[ChunkLoad], wanted: list[list[GroupLayout]]
    ) -> list[list[PageWrite]]:
        """Per layer (in forward order), the page writes of every chunk that can be loaded from
        ``load.transfer``; records in ``load`` each chunk's slots, whether it is planned, its bytes."""
        transfer = load.transfer
        plan: list[list[PageWrite]] = [[] for _ in self._layer_order]
        at = 0
        for i, (chunk, groups) in enumerate(zip(chunks, wanted)):
            objects = range(at, at + len(groups))
            at += len(groups)
            load.chunk_objects[i] = objects
            writes: list[tuple[int, PageWrite]] | None = None
            try:
                writes = (
                    None if transfer is None else self._plan_chunk(i, transfer, chunk, groups, objects, load)
                )
            except Exception as exc:  # never let a cache failure kill the forward pass
                log.warning("tiercache: loading a chunk failed: %s", exc)
            if writes is not None:
                for position, write in writes:
                    plan[position].append(write)
                assert transfer is not None
                load.nbytes[i] = sum(transfer.slot(j).nbytes for j in objects)
            load.planned.append(writes is not None)
        return plan

    def _mapped_arena(self, client: Client | None) -> SharedArena | None:
        """The server's arena as this worker's client maps it now (attached on first use)."""
        if client is None:
            return None
        try:
            return client.arena()
        except TierCacheError as exc:
            self.link.failed("mapping the server's arena for a load", exc)
            return None

    def _ticket_slots(
        self,
        client: Client | None,
        mapped: SharedArena | None,
        meta: TierCacheMetadata,
        chunks: list[ChunkLoad],
        wanted: list[list[GroupLayout]],
        keys: list[ObjectKey],
    ) -> Load | None:
        """The slots of every object of this step's load (in ``keys`` order) where the scheduler's
        lookup tickets pinned them, when the metadata names them all, in the arena ``mapped`` (the
        one this worker would copy from) and recently enough that a copy may still start in the
        leases' window (:class:`~tiercache.client.transfer.Window`); else ``None`` (the worker
        pins by key: a request that waited for blocks long after its lookup, another server)."""
        if client is None or mapped is None or not meta.loads or any(not r.leased_at for r in meta.loads):
            return None
        arenas = {r.arena for r in meta.loads}
        if len(arenas) != 1:
            return None  # slots of two servers' arenas
        out: list[Slot | None] = []
        objects = iter(keys)
        for chunk, groups in zip(chunks, wanted):
            by_group = {g: (offset, nbytes, digest) for g, offset, nbytes, digest in chunk.slots}
            for g in groups:
                at = by_group.get(g.object_group)
                if at is None:
                    return None
                out.append(Slot(next(objects).to_bytes(), at[0], at[1], 0, at[2]))
        since = min(r.leased_at for r in meta.loads)
        return Load.adopt(client, mapped, arenas.pop(), out, since)

    def _plan_chunk(
        self,
        chunk_index: int,
        transfer: Load,
        chunk: ChunkLoad,
        groups: list[GroupLayout],
        objects: range,
        load: _StepLoad,
    ) -> list[tuple[int, PageWrite]] | None:
        """The page writes of one chunk (its objects are slots ``objects`` of ``transfer``), as
        (layer position, write), each telling its slot's check what it copied; ``None`` when it
        cannot be loaded."""

        def blocks(g: GroupLayout) -> int:  # a whole chunk's blocks, or a tail object's
            return chunk.blocks or g.blocks_per_chunk

        slots = [transfer.slots[j] for j in objects]
        if not groups or any(
            s is None or s.nbytes != len(g.layer_names) * blocks(g) * g.page_bytes
            for s, g in zip(slots, groups)
        ):
            return None
        writes: list[tuple[int, PageWrite]] = []
        for g, slot, j in zip(groups, slots, objects):
            if g.is_recurrent:
                # One state page per layer, into the block vLLM assigned to the boundary state.
                ids = chunk.block_ids[g.kv_group]
                if len(ids) != 1 or not ids[0]:
                    return None  # never write the null block; vLLM recomputes instead
                pairs = [(0, ids[0])]
            else:
                # Positions are in this group's own block size. Null blocks (0) are positions a
                # sliding-window group skips; a full group has none.
                positions = chunk.positions[g.kv_group]
                pairs = [(p, b) for p, b in zip(positions, chunk.block_ids[g.kv_group]) if b]
                if not g.is_sliding and len(pairs) != len(positions):
                    return None  # never write the null block
                if any(not 0 <= p < blocks(g) for p, _ in pairs):
                    return None  # positions from another block size: refuse rather than misplace
            assert self._copy is not None and slot is not None
            src = self._copy.host(transfer.arena, slot.offset, slot.nbytes)
            src = src.view(len(g.layer_names), blocks(g), g.page_bytes)
            idx = torch.tensor([b for _, b in pairs], dtype=torch.long)
            whole = [p for p, _ in pairs] == list(range(blocks(g)))
            # The whole chunk is copied straight from the (pinned) slot; a part picks its rows.
            pos = None if whole else torch.tensor([p for p, _ in pairs], dtype=torch.long)
            check = load.checks[j] = transfer.check(j)
            part = blocks(g) * g.page_bytes  # one layer's rows of the slot
            for li, (name, pv, rows) in enumerate(
                zip(g.layer_names, self._pages[g.kv_group], src, strict=True)
            ):
                write = PageWrite(chunk_index, pv, idx, rows, pos, check, (li * part, part))
                writes.append((self._layer_position[name], write))
        return writes

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until this step's synchronous load has written every layer up to ``layer_name`` in
        forward order (a layer this worker does not know waits for all)."""
        load = self._sync_load
        if load is not None and load.job is not None:
            load.job.wait_layer(self._layer_position.get(layer_name, len(self._layer_order)))

    def _finish_loads(self, wait: bool) -> None:
        """Report and release the loads whose writes are done: this step's synchronous load always
        (waiting for it), asynchronous ones when finished (``wait``: all of them)."""
        self._sync_load = None
        pending, self._loads = self._loads, []
        for load in pending:
            if wait or load.sync or load.job is None or load.job.done():
                self._finish_load(load)
            else:
                self._loads.append(load)

    def _finish_load(self, load: _StepLoad) -> None:
        failed = load.job.finish() if load.job is not None else set()
        # Every copy is checked against its object's digest (the slot is shared memory another
        # process may have written into), and released before the report: a chunk is loaded only
        # if every lease it was copied under still held when the copy was done. An expired
        # lease's slot may have been reused meanwhile, so its bytes could be another chunk's.
        corrupt = load.verdict.result() if load.verdict is not None else _failed_checks(load.checks)
        lost = self._release(load, corrupt)
        bad = set(corrupt) | lost
        wrong = {i for i, objects in load.chunk_objects.items() if bad.intersection(objects)}
        if corrupt:
            self.stats["corrupt_copies"] += len(corrupt)
            self.recorder.add("corrupt_copies", len(corrupt))
            log.warning(
                "tiercache: %d object(s) copied out of the L1 arena did not match their digest (another "
                "process wrote into their slots); their chunks are failed loads and vLLM recomputes them",
                len(corrupt),
            )
        loaded = [ok and i not in failed and i not in wrong for i, ok in enumerate(load.planned)]
        for ok in loaded:
            self.stats["loaded_chunks" if ok else "load_failures"] += 1
            self.recorder.add("loaded_chunks" if ok else "load_failures")
        lost_chunks = {i for i, objects in load.chunk_objects.items() if lost.intersection(objects)}
        lost_planned = sum(1 for i, ok in enumerate(load.planned) if ok and i in lost_chunks)
        if lost_planned:
            self.stats["lost_leases"] += lost_planned
            self.recorder.add("lost_leases", lost_planned)
        self._report_loads(load.meta, load.owner, loaded)
        # Until the writes were done, not until this report (a synchronous load's comes after the
        # forward pass); a device load's end is only known here.
        done_at = load.job.finished_at if load.job is not None else None
        elapsed = (done_at or time.perf_counter()) - load.started
        self.recorder.add("loaded_bytes", sum(load.nbytes.get(i, 0) for i, ok in enumerate(loaded) if ok))
        self.recorder.add("load_seconds", elapsed)
        self.recorder.add("load_durations", elapsed)

    def _release(self, load: _StepLoad, corrupt: list[int]) -> set[int]:
        """Finish the load's transfer (:meth:`Load.finish <tiercache.client.transfer.Load.finish>`:
        report the ``corrupt`` copies, release this worker's pins); the slots whose copy no held
        lease vouches for. A load from the scheduler's ticket's slots has nothing to release (the
        scheduler releases the ticket after the step): every slot is lost unless its copy ended
        well inside the leases' window counted from the lookup's send."""
        transfer = load.transfer
        if transfer is None:
            return set()
        try:
            lost = transfer.finish(corrupt)
        except TierCacheError as exc:  # the report or release could not be sent: the server is away
            self.link.failed("release after a load", exc)
            return set(range(len(transfer.slots)))
        if lost:
            log.warning(
                "tiercache: %d of %d slots of a load were copied after the leases pinning them may have "
                "ended (lease_ttl_s of the server's L1 is shorter than the load took); their chunks are "
                "reported as failed loads and vLLM recomputes them",
                len(lost),
                len(transfer.slots),
            )
        return lost

    def _report_loads(self, meta: TierCacheMetadata, owner: list[int], loaded: list[bool]) -> None:
        """Record each request's outcome (``loaded`` may be short: chunks not reached failed)."""
        ok = loaded + [False] * (len(owner) - len(loaded))
        with self._lock:
            for i, load in enumerate(meta.loads):
                chunks_ok = [k for o, k in zip(owner, ok) if o == i]
                if load.asynchronous:
                    self._recv_done.add(load.req_id)
                    # Stores of a preempted earlier run of this request were flushed at the
                    # preemption; the scheduler no longer holds the request for them either.
                    self._with_saves.discard(load.req_id)
                    if not (load.complete and all(chunks_ok)):
                        self._recv_failed.add(load.req_id)
                else:
                    self._load_errors.update(
                        b
                        for chunk, k in zip(load.chunks, chunks_ok)
                        if not k
                        for ids in chunk.block_ids
                        for b in ids
                        if b
                    )

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_loads(wait=False)
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors


def _failed_checks(checks: dict[int, SlotCheck]) -> list[int]:
    """The slots whose copy does not match its object's digest."""
    return [j for j, check in checks.items() if not check.ok()]
