"""The worker half: runs in each vLLM worker process, next to the KV cache.

* ``register_kv_caches`` (once, at start-up): check the derived layout against the real tensors,
  build per layer a page view per manager block over the KV memory, pick the copy engine for the
  tensors' device, connect, register the object groups of this rank and map the server's L1 arena.
* Loads (``handle_preemptions``, at the very start of the step; ``start_load_kv`` is the fallback
  if that hook did not see the step). The scheduler's lookup ticket has promoted the hit objects
  into L1 and pins them until the step has run; the load names their slots, so the worker starts
  a load job (:mod:`~tiercache.connector.loads`) that writes them into the requests' blocks in
  the layers' forward order with no round trip, and trusts the bytes only if the job ended well
  inside the leases' TTL counted from the lookup's send (else the chunks are failed loads). A load
  that names no slots, or slots in another server's arena, pins by key instead (one round trip)
  and releases the pins once the job is finished. Two kinds
  (``RequestLoad.asynchronous``):

  - synchronous (one KV-cache group, dense models): the request runs in this very step. With
    ``overlap_loads`` the writes run during the forward pass and ``wait_for_layer_load`` holds each
    attention layer until its pages are written; without (the default), they precede the forward
    pass (on CUDA: ordered before it on the device, the host does not wait). The job is finished
    at the end of the step (``wait_for_save``); a chunk that cannot be loaded (server gone, object
    evicted, wrong size, a failed write) puts its blocks into ``get_block_ids_with_load_errors``
    and vLLM recomputes them.
  - asynchronous (several KV-cache groups, or recurrent state): vLLM parked the request in
    ``WAITING_FOR_REMOTE_KVS`` and runs it in a later step. At the end of the first step after its
    job is done (this very step unless writes overlap) the request is reported in
    ``finished_recving`` (every worker reports each request once, loaded or not), and a load with
    any failed chunk also in ``failed_recving``: vLLM frees its blocks and computes the request
    from scratch. vLLM cannot map block ids back to requests when there are several groups, so
    none are reported as load errors.
* Recurrent groups (Mamba/GDN state): an object is one state page per layer (the unpadded bytes of
  the ``[blocks, 1, 1, state bytes]`` view); a save reads the block vLLM handed over for the chunk's
  end boundary, a load writes the block it assigned to the hit boundary (``ChunkLoad.state``).
* Saves (``wait_for_save``, after the forward pass): queued to one background thread
  (``tiercache-connector-save``) that reserves arena slots, copies the pages of the chunk's blocks in
  and commits. The scheduler holds finished requests' blocks until ``get_finished`` reports them; it
  waits for that request's queued saves first, so reported blocks are never read again. When
  requests were preempted (their blocks may be rewritten this step) every queued save is finished
  before the forward pass (``handle_preemptions``). A producer (``kv_role`` ``kv_producer``: a
  prefill engine whose decode engine asks the same server next) reserves this step's chunks in
  ``wait_for_save`` itself (one round trip, bounded by ``timeout_s``, not behind the copies still
  queued), and the thread then copies and commits them: its response
  can then never reach the decode engine before the server knows the chunks are coming, and a
  decode lookup waits for their commit (``inflight_wait_s``) instead of missing.

Copies go through a :class:`~tiercache.connector.copy.PageCopyEngine` chosen from the KV tensors'
device (CPU: plain ``torch`` copies; CUDA: pinned arena, DMA on a side stream ordered by events), over
per-layer :class:`~tiercache.connector.pages.PageView` at manager-block granularity (vLLM may split
a manager block into kernel blocks and lay pages out as several runs).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tiercache.client.affinity import describe_binding, spread_current_thread
from tiercache.client.client import Client
from tiercache.client.link import LinkFactory, ServerLink
from tiercache.client.transfer import Load, SlotCheck, Store
from tiercache.config.connector import ConnectorSettings
from tiercache.connector.copy import PageCopyEngine, select_copy_engine
from tiercache.connector.layout import (
    EngineLayout,
    GroupLayout,
    derive_layout,
    parallel_rank,
    verify_kv_caches,
)
from tiercache.connector.loads import LoadJob, PageWrite, forward_order
from tiercache.connector.metadata import ChunkLoad, ChunkSave, TierCacheMetadata
from tiercache.connector.pages import PageView
from tiercache.connector.stats import StatsRecorder, TierCacheConnectorStats
from tiercache.errors import ConfigError, TierCacheError
from tiercache.keys import Fingerprint, ObjectKey
from tiercache.keys.digest import Digest
from tiercache.l1.arena import SharedArena
from tiercache.wire.protocol import Slot

log = logging.getLogger(__name__)

_STOP = object()


@dataclass(eq=False)
class _StepLoad:
    """One step's loads from start to report (see :meth:`WorkerHalf.start_load_kv`)."""

    meta: TierCacheMetadata
    owner: list[int]  # chunk → index of its request in ``meta.loads``
    started: float
    #: The slots copied from (the scheduler's ticket's, adopted, or pinned here), or ``None``.
    transfer: Load | None = None
    ticket_slots: bool = False  # copied from the scheduler's ticket's slots: no pin, no release
    chunk_objects: dict[int, range] = field(default_factory=dict)  # per chunk: its slots' indexes
    checks: dict[int, SlotCheck] = field(default_factory=dict)  # per planned slot: its copy's check
    #: The slots whose copy failed its check, worked out by the check thread during the forward pass.
    verdict: Future[list[int]] | None = None
    planned: list[bool] = field(default_factory=list)  # per chunk: its writes are in the job
    nbytes: dict[int, int] = field(default_factory=dict)  # per planned chunk: bytes it loads
    job: LoadJob | None = None

    @property
    def sync(self) -> bool:
        """Whether it feeds this very step's forward pass (some request's load is synchronous)."""
        return not all(r.asynchronous for r in self.meta.loads)


@dataclass(eq=False)
class _Reservation:
    """A save batch's reservation (``store``: its slots, in the order of ``sources``, the group and
    save of each object); ``skipped``: nothing was reserved although the batch had objects (server
    down, L1 full); neither: nothing in the batch to store."""

    store: Store | None = None
    sources: list[tuple[GroupLayout, ChunkSave]] = field(default_factory=list)
    skipped: bool = False


class WorkerHalf:
    """See the module docstring. Engine-facing methods run on the worker's model-runner thread."""

    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        settings: ConnectorSettings,
        *,
        link: LinkFactory = ServerLink,
        reserve_before_return: bool = False,
    ) -> None:
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._settings = settings
        self._reserve_before_return = reserve_before_return  # a producer's (see the module docstring)
        self._rank = 0
        self._groups: list[GroupLayout] = []
        self._fingerprints: dict[int, Fingerprint] = {}
        self._pages: dict[int, list[PageView]] = {}  # kv group → per-layer page views
        self._copy: PageCopyEngine | None = None
        self._kv_caches: dict[str, torch.Tensor] | None = None
        self._lock = threading.Lock()  # guards _pending, _with_saves, _load_errors
        self._idle = threading.Condition(self._lock)
        self._pending: dict[str, int] = defaultdict(int)  # req → queued saves not finished
        self._with_saves: set[str] = set()  # reqs that had saves: report each once finished
        self._finished_waiting: set[str] = set()
        self._load_errors: set[int] = set()
        self._recv_done: set[str] = set()  # asynchronous loads done this step (reported once)
        self._recv_failed: set[str] = set()  # ... of which some chunk failed
        self._loaded_step = -1  # the step whose loads started (handle_preemptions or start_load_kv)
        self._loads: list[_StepLoad] = []  # started, not yet reported (model-runner thread only)
        self._sync_load: _StepLoad | None = None  # this step's load the forward pass waits for
        self._layer_order: list[str] = []  # every KV layer, in forward order
        self._layer_position: dict[str, int] = {}
        # Writes may still run when the forward pass starts. Off by default: on CPU the writing
        # thread competes with the forward pass's threads (hit TTFT measured 97 ms overlapped vs
        # 67 ms not, docs/benchmarks.md); on CUDA the per-layer waits need PIECEWISE CUDA graphs.
        self._overlap = settings.overlap_loads
        self._queue: queue.Queue[Any] = queue.Queue()
        self._saver: threading.Thread | None = None
        # Checks of inline loads' copies, during the forward pass; started from the model-runner
        # thread, it moves off that thread's cores as the connector's other threads do.
        self._checker = ThreadPoolExecutor(
            1, thread_name_prefix="tiercache-connector-check", initializer=spread_current_thread
        )
        self.link = link(settings, "vllm-worker", self._on_connect)
        self.stats = {
            "loaded_chunks": 0,
            "load_failures": 0,
            "lost_leases": 0,
            "saved_chunks": 0,
            "save_skipped": 0,
            "corrupt_copies": 0,
            "stale_reservations": 0,
        }
        self.recorder = StatsRecorder()  # the same events per interval, for vLLM's metrics
        self._outages_counted = 0

    # -- start-up ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # Which object groups are this worker's (one per KV-cache group); raises rather than guess.
        self._rank = parallel_rank(getattr(self._vllm_config, "parallel_config", None))
        self._kv_caches = kv_caches
        self.order_layers(kv_caches)
        self._copy = select_copy_engine(kv_caches.values())
        binding = describe_binding()
        if binding is not None:
            log.info("tiercache: %s", binding)
        self.link.start()
        self._saver = threading.Thread(target=self._save_loop, name="tiercache-connector-save", daemon=True)
        self._saver.start()

    def order_layers(self, layer_names: Iterable[str]) -> None:
        """Learn the KV layers' forward order: loads are written (and waited for) in it."""
        self._layer_order = forward_order(layer_names)
        self._layer_position = {name: i for i, name in enumerate(self._layer_order)}

    def _on_connect(self, client: Client) -> None:
        assert self._kv_caches is not None
        layout: EngineLayout = derive_layout(
            self._vllm_config, self._kv_cache_config, client.server.chunk_size, self._settings.weights_id
        )
        groups = layout.for_rank(self._rank)
        forward_context = getattr(self._vllm_config.compilation_config, "static_forward_context", None)
        pages = verify_kv_caches(groups, self._kv_caches, forward_context)
        refs = client.register([(g.object_group, g.manifest) for g in groups])
        for g, ref in zip(groups, refs):
            if ref.fingerprint != g.fingerprint.raw:
                raise ConfigError("tiercache: the server computed another fingerprint for our manifest")
        assert self._copy is not None
        self._copy.attach(client.arena())
        self.use_layout(groups, pages, {g.object_group: g.fingerprint for g in groups}, self._copy)

    def use_layout(
        self,
        groups: list[GroupLayout],
        pages: dict[int, list[PageView]],
        fingerprints: dict[int, Fingerprint],
        copy: PageCopyEngine,
    ) -> None:
        """Load and store ``groups`` (this rank's), whose KV pages are ``pages`` (by KV-cache group),
        with these fingerprints, copying through ``copy`` (attached to the server's arena)."""
        self._copy = copy
        self._pages = pages
        self._fingerprints = fingerprints
        self._groups = groups

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
        load = _StepLoad(meta, owner, started, transfer, ticket_slots=ticket is not None)
        try:
            plan: list[list[PageWrite]] = [[] for _ in self._layer_order]
            at = 0
            for i, (chunk, groups) in enumerate(zip(chunks, wanted)):
                objects = range(at, at + len(groups))
                at += len(groups)
                load.chunk_objects[i] = objects
                writes: list[tuple[int, PageWrite]] | None = None
                try:
                    writes = (
                        None
                        if transfer is None
                        else self._plan_chunk(i, transfer, chunk, groups, objects, load)
                    )
                except Exception as exc:  # never let a cache failure kill the forward pass
                    log.warning("tiercache: loading a chunk failed: %s", exc)
                if writes is not None:
                    for position, write in writes:
                        plan[position].append(write)
                    assert transfer is not None
                    load.nbytes[i] = sum(transfer.slot(j).nbytes for j in objects)
                load.planned.append(writes is not None)
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
        self._queue.put((ready, batch, early))

    def handle_preemptions(self, meta: TierCacheMetadata | None) -> None:
        """The first hook of every step, before vLLM prepares inputs: finish queued saves whose
        blocks may be rewritten (``meta.flush``), then do this step's loads (see module docstring)."""
        if self._sync_load is not None:  # the last step ended without its end-of-step hooks
            self._finish_loads(wait=False)
        if meta is not None and meta.flush:
            self._wait_idle(None)
        self.start_load_kv(meta)

    def quiesce(self) -> None:
        """Finish every load in flight (reported as usual) and every queued store: afterwards the
        connector touches no KV block until the next step."""
        self._finish_loads(wait=True)
        self._wait_idle(None)

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
            ready, batch, early = item
            started = time.perf_counter()
            saved, skipped, stored_bytes = self.stats["saved_chunks"], self.stats["save_skipped"], 0
            try:
                stored_bytes = self._save_batch(batch, ready, early)
            except Exception as exc:  # a failed store is a skipped store, never a crash
                log.warning("tiercache: storing %d chunk(s) failed: %s", len(batch), exc)
                self.stats["save_skipped"] += len(batch)
            finally:
                # This thread is the only writer of the store counters: the deltas are this batch's.
                self._record_store(
                    self.stats["saved_chunks"] - saved,
                    self.stats["save_skipped"] - skipped,
                    stored_bytes,
                    time.perf_counter() - started,
                )
                with self._idle:
                    for save in batch:
                        self._pending[save.req_id] -= 1
                        if self._pending[save.req_id] <= 0:
                            del self._pending[save.req_id]
                    self._idle.notify_all()

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
            g, save = sources[i]
            n = save.blocks or g.blocks_per_chunk
            dst = copy.host(store.arena, store.slot(i).offset, len(target))
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

    # -- step results --------------------------------------------------------------------------
    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` for this step: the asynchronous
        loads done since the last call (failed ones in both of the last two), and the finished
        requests whose blocks the scheduler held for our stores, once those are done."""
        self._finish_loads(wait=False)
        with self._lock:
            recving, self._recv_done = self._recv_done, set()
            failed, self._recv_failed = self._recv_failed, set()
        sending, _ = self.get_finished(finished_req_ids)
        return sending or set(), recving, failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Report requests whose blocks the scheduler held for our stores, once those are done
        (loads are reported by :meth:`transfer_results`, which calls this).

        Waits for the finishing requests' own queued stores (usually already done: they were
        queued steps ago), so a reported request's blocks are never read again.
        """
        with self._lock:
            self._finished_waiting.update(r for r in finished_req_ids if r in self._with_saves)
            waiting = list(self._finished_waiting)
        if not waiting:
            return None, None
        for rid in waiting:
            self._wait_idle(rid)
        with self._lock:
            for rid in waiting:
                self._with_saves.discard(rid)
                self._finished_waiting.discard(rid)
        return set(waiting), None

    def take_stats(self) -> TierCacheConnectorStats | None:
        """Loads and stores since the last call, and server outages this worker noticed."""
        outages = self.link.outages
        if outages != self._outages_counted:
            self.recorder.add("server_unavailable", outages - self._outages_counted)
            self._outages_counted = outages
        return self.recorder.take()

    def shutdown(self) -> None:
        """Finish loads in flight and queued stores (bounded by the client's timeouts), then disconnect."""
        self._finish_loads(wait=True)
        if self._saver is not None and self._saver.is_alive():
            self._queue.put(_STOP)
            self._saver.join(30)
        self.link.close()
        if self._copy is not None:
            self._copy.close()
        self._checker.shutdown(wait=True)


def _failed_checks(checks: dict[int, SlotCheck]) -> list[int]:
    """The slots whose copy does not match its object's digest."""
    return [j for j, check in checks.items() if not check.ok()]


def _zeros_allowed(save: ChunkSave, g: GroupLayout) -> bool:
    """Whether ``save`` may hold zeros for ``g``'s null blocks: a tail's sliding group, whose first
    blocks vLLM freed before the store (:meth:`SchedulerHalf._plan_tail_saves
    <tiercache.connector.scheduler.SchedulerHalf._plan_tail_saves>`)."""
    return save.blocks > 0 and g.is_sliding
