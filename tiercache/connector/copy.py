"""Page copy engines: move pages between a worker's KV tensors and the mapped L1 arena.

The worker asks one engine for every copy; :func:`select_copy_engine` picks it from the KV tensors'
device.

* :class:`CpuPageCopy` — ``index_select`` / ``index_copy_`` straight between the KV memory and the
  arena mapping, on the calling thread (the connector's behaviour before engines existed).
* :class:`CudaPageCopy` — the arena mapping is registered as pinned host memory once per arena (by
  :class:`tiercache.l1.copy.CudaCopyBackend`, reused here) and every copy runs on that back-end's
  side stream:

  - saves: the model-runner thread records an event on the compute stream after the forward pass
    (:meth:`PageCopyEngine.save_point`); the save thread makes the side stream wait for it, gathers
    the blocks' pages on the GPU and copies them device→host with ``non_blocking=True``, then waits
    for the side stream's event, so the caller commits only bytes that have landed;
  - loads: the side stream first waits for the compute stream (blocks may still be read by the
    previous step), copies host→device and scatters into the blocks; the compute stream waits on the
    side stream's event (so attention never reads a block before its bytes arrived), and the host
    waits for that event before returning so the caller may release the arena slots.

Both engines take the same arguments: :class:`~tiercache.connector.pages.PageView` per layer, the
block ids as a CPU ``int64`` tensor, and per layer a host ``uint8`` tensor ``[len(ids), page_bytes]``
(a view of the arena slot from :meth:`PageCopyEngine.host`).
"""

from __future__ import annotations

import threading
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from tiercache.connector.pages import PageView
from tiercache.errors import ConfigError, CopyBackendError
from tiercache.l1.arena import SharedArena


class PageCopyEngine(ABC):
    """Copies pages between KV tensors on one device and the L1 arena (see module docstring)."""

    name: str = "copy"

    def attach(self, arena: SharedArena) -> None:
        """Prepare for copies with ``arena`` (called on every (re)connect; cheap if unchanged)."""
        return None

    def host(self, arena: SharedArena, offset: int, nbytes: int) -> torch.Tensor:
        """A writable uint8 tensor over arena bytes ``[offset, offset + nbytes)`` (no copy)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # frombuffer on a writable mmap is fine
            return torch.frombuffer(arena.view(offset, nbytes), dtype=torch.uint8)

    def save_point(self) -> Any:
        """Called on the model-runner thread right after the forward pass; what :meth:`save` must
        wait for before reading the KV tensors (``None`` when nothing)."""
        return None

    @abstractmethod
    def save(self, ready: Any, pages: Sequence[PageView], ids: torch.Tensor, dsts: Sequence[torch.Tensor]) -> None:
        """Copy the pages of blocks ``ids`` of each layer into ``dsts[layer]``; returns once the bytes
        are in host memory. Raises :class:`CopyBackendError` when the device reports an error."""

    @abstractmethod
    def load(self, pages: Sequence[PageView], ids: torch.Tensor, srcs: Sequence[torch.Tensor]) -> None:
        """Write ``srcs[layer]`` into the pages of blocks ``ids``; returns once ``srcs`` may be reused,
        with later work on the current stream ordered after the writes."""

    def close(self) -> None:
        """Release registrations and streams. Idempotent."""
        return None


class CpuPageCopy(PageCopyEngine):
    """Plain torch copies on the calling thread (KV tensors in host memory)."""

    name = "cpu"

    def save(self, ready: Any, pages: Sequence[PageView], ids: torch.Tensor, dsts: Sequence[torch.Tensor]) -> None:
        for pv, dst in zip(pages, dsts, strict=True):
            pv.gather(ids, dst)

    def load(self, pages: Sequence[PageView], ids: torch.Tensor, srcs: Sequence[torch.Tensor]) -> None:
        for pv, src in zip(pages, srcs, strict=True):
            pv.scatter(ids, src)


class CudaPageCopy(PageCopyEngine):
    """Asynchronous DMA through the pinned arena on a side stream (see module docstring)."""

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise CopyBackendError(
                "tiercache: the KV cache is on a CUDA device but torch.cuda.is_available() is False in this "
                "process; check CUDA_VISIBLE_DEVICES and the driver"
            )
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self._lock = threading.Lock()  # attach() runs on the link thread, copies on others
        self._backend: Any = None
        self._arena: SharedArena | None = None  # the mapping registered (identity, not name: a
        # restarted server may reuse the name for a new file, which is a new mapping)

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

    def save(self, ready: Any, pages: Sequence[PageView], ids: torch.Tensor, dsts: Sequence[torch.Tensor]) -> None:
        stream = self._pinned().stream
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                if ready is not None:
                    stream.wait_event(ready)  # the forward pass that wrote these blocks is done
                idx = ids.to(self.device, non_blocking=True)
                for pv, dst in zip(pages, dsts, strict=True):
                    staged = torch.empty(dst.shape, dtype=torch.uint8, device=self.device)
                    pv.gather(idx, staged)  # pages are strided runs: gather on the GPU, one DMA out
                    dst.copy_(staged, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            done.synchronize()  # commit only bytes that landed
        except RuntimeError as exc:
            raise CopyBackendError(f"tiercache: CUDA copy of a store failed: {exc}") from exc

    def load(self, pages: Sequence[PageView], ids: torch.Tensor, srcs: Sequence[torch.Tensor]) -> None:
        stream = self._pinned().stream
        compute = torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                stream.wait_stream(compute)  # earlier kernels may still use these blocks' memory
                idx = ids.to(self.device, non_blocking=True)
                for pv, src in zip(pages, srcs, strict=True):
                    staged = src.to(self.device, non_blocking=True)
                    pv.scatter(idx, staged)
                done = torch.cuda.Event()
                done.record(stream)
            compute.wait_event(done)  # attention reads the blocks only after they arrived
            done.synchronize()  # the arena slots may be released (and reused) after this
        except RuntimeError as exc:
            raise CopyBackendError(f"tiercache: CUDA copy of a load failed: {exc}") from exc

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
