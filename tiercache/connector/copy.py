"""Page copy engines: move pages between a worker's KV tensors and the mapped L1 arena.

The worker asks one engine for every copy; :func:`select_copy_engine` picks it from the KV tensors'
device.

* :class:`CpuPageCopy` — ``index_select`` / slice copies straight between the KV memory and the
  arena mapping: saves on the calling thread, overlapped loads on a background thread
  (:class:`~tiercache.connector.loads.ThreadedLoad`).
* :class:`CudaPageCopy` — the arena mapping is registered as pinned host memory once per arena (by
  :class:`tiercache.l1.copy.CudaCopyBackend`, reused here) and every copy runs on that back-end's
  side stream:

  - saves: the model-runner thread records an event on the compute stream after the forward pass
    (:meth:`PageCopyEngine.save_point`); the save thread makes the side stream wait for it, gathers
    the blocks' pages on the GPU and copies them device→host with ``non_blocking=True``, then waits
    for the side stream's event, so the caller commits only bytes that have landed;
  - loads: the side stream first waits for the compute stream (blocks may still be read by the
    previous step), then copies host→device and scatters into the blocks layer by layer, recording
    an event after each layer. With overlap, the compute stream waits on layer ``i``'s event when
    the forward pass reaches layer ``i`` (``wait_for_layer_load``); without, it waits on the last
    event at once. Either way the host does not block until the job's ``finish`` (end of the step),
    after which the arena slots may be released.

Loads are :mod:`~tiercache.connector.loads` plans (per layer position, that layer's page writes)
turned into a :class:`~tiercache.connector.loads.LoadJob` by :meth:`PageCopyEngine.start_load`.
Saves take :class:`~tiercache.connector.pages.PageView` per layer, the block ids as a CPU ``int64``
tensor, and per layer a host ``uint8`` tensor ``[len(ids), page_bytes]`` (a view of the arena slot
from :meth:`PageCopyEngine.host`).
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from tiercache.client.tensors import arena_bytes, feed
from tiercache.connector.loads import (
    FinishedLoad,
    LoadJob,
    LoadPlan,
    PageWrite,
    ThreadedLoad,
    run_layer,
    run_writes,
)
from tiercache.connector.pages import PageView
from tiercache.errors import ConfigError, CopyBackendError
from tiercache.keys.digest import Digest
from tiercache.l1.arena import SharedArena

log = logging.getLogger(__name__)


class PageCopyEngine(ABC):
    """Copies pages between KV tensors on one device and the L1 arena (see module docstring)."""

    name: str = "copy"

    def attach(self, arena: SharedArena) -> None:
        """Prepare for copies with ``arena`` (called on every (re)connect; cheap if unchanged)."""
        return None

    def host(self, arena: SharedArena, offset: int, nbytes: int) -> torch.Tensor:
        """A writable uint8 tensor over arena bytes ``[offset, offset + nbytes)`` (no copy)."""
        return arena_bytes(arena, offset, nbytes)

    def save_point(self) -> Any:
        """Called on the model-runner thread right after the forward pass; what :meth:`save` must
        wait for before reading the KV tensors (``None`` when nothing)."""
        return None

    @abstractmethod
    def save(
        self,
        ready: Any,
        pages: Sequence[PageView],
        ids: torch.Tensor,
        dsts: Sequence[torch.Tensor],
        digest: Digest,
        zeros: int = 0,
    ) -> None:
        """Copy the pages of blocks ``ids`` of each layer into ``dsts[layer]``; returns once the bytes
        are in host memory. Feeds ``digest``, per layer, ``zeros`` zero pages (rows the caller
        zeroed before ``dsts``) and then the pages copied, read from this process's own memory,
        never from the arena (:class:`~tiercache.client.transfer.Store`). Raises
        :class:`CopyBackendError` when the device reports an error."""

    @abstractmethod
    def start_load(self, plan: LoadPlan, overlap: bool) -> LoadJob:
        """Start ``plan``'s writes. With ``overlap`` they may still be running when this returns
        (the forward pass waits per layer with :meth:`LoadJob.wait_layer`); without, every later use
        of the KV tensors is ordered after them. The sources stay in use until :meth:`LoadJob.finish`."""

    def close(self) -> None:
        """Release registrations and streams. Idempotent."""
        return None


class CpuPageCopy(PageCopyEngine):
    """Plain torch copies on the calling thread (KV tensors in host memory)."""

    name = "cpu"

    def save(
        self,
        ready: Any,
        pages: Sequence[PageView],
        ids: torch.Tensor,
        dsts: Sequence[torch.Tensor],
        digest: Digest,
        zeros: int = 0,
    ) -> None:
        blocks = ids.tolist()
        for pv, dst in zip(pages, dsts, strict=True):
            if zeros:
                digest.update(bytes(zeros * pv.page_bytes))
            pv.copy_out(digest, blocks, dst)  # the source pages, hashed piece by piece as copied

    def start_load(self, plan: LoadPlan, overlap: bool) -> LoadJob:
        """Overlapped: a thread writes layer by layer and hashes each part for its check right
        after copying it (still in cache). Inline: the writes only; the checks hash later, off the
        forward pass's path (:meth:`WorkerLoads.start_load_kv
        <tiercache.connector.worker_loads.WorkerLoads.start_load_kv>`)."""
        if overlap:
            return ThreadedLoad(plan, _write_checked)
        failed: set[int] = set()
        run_writes(plan, _write_page, failed)
        return FinishedLoad(failed)


def _write_page(w: PageWrite) -> None:
    w.pages.scatter(w.ids, w.rows())


def _write_checked(w: PageWrite) -> None:
    _write_page(w)
    if w.check is not None:  # the slot's part is still in cache: hash it for the check now
        w.check.copied(*w.part)


class CudaPageCopy(PageCopyEngine):
    """Asynchronous DMA through the pinned arena on a side stream (see module docstring)."""

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise CopyBackendError(
                "tiercache: the KV cache is on a CUDA device but torch.cuda.is_available() is False in this "
                "process; check CUDA_VISIBLE_DEVICES and the driver"
            )
        self.device = torch.device(
            "cuda", device.index if device.index is not None else torch.cuda.current_device()
        )
        self._lock = threading.Lock()  # attach() runs on the link thread, copies on others
        self._backend: Any = None
        self._arena: SharedArena | None = None  # the mapping registered (identity, not name: a
        # restarted server may reuse the name for a new file, which is a new mapping)
        self._own: torch.Tensor | None = None  # a store's pages, hashed before they enter the arena

    def attach(self, arena: SharedArena) -> None:
        from tiercache.l1.copy import CudaCopyBackend

        with self._lock:
            if self._backend is not None and self._arena is arena:
                return
            if self._backend is not None:
                self._backend.close()  # a new server (arena): waits for copies in flight first
            with torch.cuda.device(self.device):  # cudaHostRegister binds to the current device
                self._backend = CudaCopyBackend(arena, device=self.device.index)
            self._arena = arena

    def _pinned(self) -> Any:
        backend = self._backend
        if backend is None:
            raise CopyBackendError("tiercache: CUDA page copy used before attach(arena); this is a bug")
        return backend

    def host(self, arena: SharedArena, offset: int, nbytes: int) -> torch.Tensor:
        """A slice of the registered (pinned) mapping: only pinned memory makes copies asynchronous."""
        backend = self._pinned()
        if arena is not self._arena:
            raise CopyBackendError(
                f"tiercache: arena {arena.name!r} is not the mapping registered for CUDA copies (the server "
                "changed since the last connect); this copy is skipped and the next connect re-registers"
            )
        return backend.host[offset : offset + nbytes]

    def save_point(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def save(
        self,
        ready: Any,
        pages: Sequence[PageView],
        ids: torch.Tensor,
        dsts: Sequence[torch.Tensor],
        digest: Digest,
        zeros: int = 0,
    ) -> None:
        """The pages leave the GPU into pinned memory of this process's own, are hashed there
        (the digest must not be read from the shared arena) and copied into the slot on the host."""
        stream = self._pinned().stream
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                if ready is not None:
                    stream.wait_event(ready)  # the forward pass that wrote these blocks is done
                idx = ids.to(self.device, non_blocking=True)
                own = self._own_buffer(sum(d.numel() for d in dsts))
                at = 0
                landed = []
                for pv, dst in zip(pages, dsts, strict=True):
                    staged = torch.empty(dst.shape, dtype=torch.uint8, device=self.device)
                    pv.gather(idx, staged)  # pages are strided runs: gather on the GPU, one DMA out
                    mine = own[at : at + dst.numel()].view(dst.shape)
                    mine.copy_(staged, non_blocking=True)
                    landed.append(mine)
                    at += dst.numel()
                done = torch.cuda.Event()
                done.record(stream)
            done.synchronize()  # only bytes that landed are hashed and committed
        except RuntimeError as exc:
            raise CopyBackendError(f"tiercache: CUDA copy of a store failed: {exc}") from exc
        for mine, dst, pv in zip(landed, dsts, pages, strict=True):
            if zeros:
                digest.update(bytes(zeros * pv.page_bytes))
            feed(digest, mine)
            dst.copy_(mine)

    def _own_buffer(self, nbytes: int) -> torch.Tensor:
        """Pinned host memory of this process's own, at least ``nbytes``, reused by every store
        (the save thread is the only caller)."""
        if self._own is None or self._own.numel() < nbytes:
            self._own = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._own

    def start_load(self, plan: LoadPlan, overlap: bool) -> LoadJob:
        return _CudaLoad(self, plan, overlap)

    def close(self) -> None:
        with self._lock:
            if self._backend is not None:
                self._backend.close()
                self._backend = None
                self._arena = None


def select_copy_engine(tensors: Iterable[torch.Tensor]) -> PageCopyEngine:
    """The engine for KV tensors on one device: CPU → :class:`CpuPageCopy`, CUDA →
    :class:`CudaPageCopy`. Mixed devices or other device types are a :class:`ConfigError`."""
    devices = {t.device for t in tensors}
    if not devices:
        raise ConfigError("tiercache: vLLM registered no KV tensors with the connector")
    if len(devices) > 1:
        raise ConfigError(
            f"tiercache: this worker's KV tensors are on several devices ({sorted(map(str, devices))}); the "
            "connector expects one device per worker process"
        )
    device = devices.pop()
    if device.type == "cpu":
        return CpuPageCopy()
    if device.type == "cuda":
        return CudaPageCopy(device)
    raise ConfigError(
        f"tiercache: KV tensors on {device.type!r} are not supported (only cpu and cuda); remove the tiercache "
        "kv-transfer-config for this engine"
    )


class _CudaLoad(LoadJob):
    """A load enqueued on the side stream, one event per layer position (module docstring)."""

    def __init__(self, engine: CudaPageCopy, plan: LoadPlan, overlap: bool) -> None:
        self._device = engine.device
        self._failed: set[int] = set()
        self._chunks = {w.chunk for writes in plan for w in writes}
        self._events: list[Any] = []
        self._finished = False
        stream = engine._pinned().stream
        compute = torch.cuda.current_stream(self._device)
        with torch.cuda.device(self._device), torch.cuda.stream(stream):
            stream.wait_stream(compute)  # earlier kernels may still use these blocks' memory
            for writes in plan:
                run_layer(writes, self._write, self._failed)
                event = torch.cuda.Event()
                event.record(stream)
                self._events.append(event)
        if self._events and not overlap:
            compute.wait_event(self._events[-1])  # nothing reads a block before its bytes arrived

    def _write(self, w: PageWrite) -> None:
        try:
            idx = w.ids.to(self._device, non_blocking=True)
            w.pages.scatter(idx, w.rows().to(self._device, non_blocking=True))
        except RuntimeError as exc:
            raise CopyBackendError(f"tiercache: CUDA copy of a load failed: {exc}") from exc

    def wait_layer(self, position: int) -> None:
        if self._events:
            torch.cuda.current_stream(self._device).wait_event(
                self._events[min(position, len(self._events) - 1)]
            )

    def done(self) -> bool:
        return self._finished or not self._events or bool(self._events[-1].query())

    def finish(self) -> set[int]:
        if not self._finished and self._events:
            try:
                self._events[-1].synchronize()  # the arena slots may be released (and reused) after this
            except RuntimeError as exc:  # an asynchronous CUDA error: no write can be trusted
                log.warning("tiercache: CUDA copy of a load failed: %s", exc)
                self._failed |= self._chunks
        self._finished = True
        return self._failed
