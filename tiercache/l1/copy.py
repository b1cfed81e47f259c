"""Copy back-ends: move KV pages between engine memory and L1 arena slots.

One code path, two back-ends (see DESIGN "Processes and the data plane"): the worker half of the
connector builds a batch of ``(dst, src)`` pairs and hands it to a :class:`CopyBackend`; the back-end
returns a :class:`CopyJob` at once and the worker reports completion to the server when the job is
done. A failed copy is a result value (``CopyResult(success=False, error=...)``), never an exception
thrown from another thread or stream.

Each side of a pair is an :class:`~tiercache.l1.arena.ArenaSlot` (an offset into the back-end's
arena, as the server sends it), or any C-contiguous buffer (``memoryview``, ``bytearray``, numpy
array); :class:`CudaCopyBackend` also takes torch tensors on the GPU or CPU. Sizes are compared in
bytes and must match exactly.

* :class:`CpuCopyBackend` — numpy memcpy, inline (the job is finished when ``copy`` returns) or on one
  background thread. For vLLM's CPU back-end and for tests.
* :class:`CudaCopyBackend` — registers this process's mapping of the arena as pinned memory
  (``cudaHostRegister``), copies with ``non_blocking=True`` on its own stream ordered after the current
  (compute) stream, and completes the job through a CUDA event. torch is imported only when it is
  constructed: ``import tiercache.l1`` never imports torch.
"""

from __future__ import annotations

import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiercache.errors import CopyBackendError
from tiercache.l1.arena import ArenaSlot, SharedArena

#: One side of a copy: an arena slot, a buffer-protocol object, or (CUDA back-end) a torch tensor.
CopyTarget = Any
CopyPair = tuple[CopyTarget, CopyTarget]  # (dst, src)


@dataclass(frozen=True, slots=True)
class CopyResult:
    """How a copy job ended. ``error`` says what failed when ``success`` is false."""

    success: bool
    nbytes: int
    error: str | None = None


class CopyJob(ABC):
    """A batch of copies in flight. Poll with :meth:`done`, block with :meth:`wait`."""

    @abstractmethod
    def done(self) -> bool:
        """Whether the batch finished (successfully or not). Never blocks."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> CopyResult | None:
        """Block until the batch finished and return its result; ``None`` if ``timeout`` ran out."""


class CopyBackend(ABC):
    """Copies batches of pages between engine memory and arena slots. Runs in a worker process."""

    #: Short name for logs ("cpu", "cuda").
    name: str = "copy"

    @abstractmethod
    def copy(self, pairs: Sequence[CopyPair]) -> CopyJob:
        """Start copying every ``(dst, src)`` pair; returns without waiting for the bytes to move.

        Raises ``ValueError`` before anything is copied if a pair's sizes differ or a destination is
        read-only: those are caller bugs, not copy failures.
        """

    def close(self) -> None:
        """Release threads, registrations and streams. Idempotent; waits for jobs in flight."""

    def __enter__(self) -> CopyBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- CPU -------------------------------------------------------------------------------------------
class _FinishedJob(CopyJob):
    def __init__(self, result: CopyResult) -> None:
        self._result = result

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> CopyResult:
        return self._result


class _FutureJob(CopyJob):
    def __init__(self, future: Future[CopyResult]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> CopyResult | None:
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            return None


def _byte_array(target: CopyTarget, arena: SharedArena | None, *, writable: bool) -> np.ndarray:
    """A flat uint8 numpy view of ``target`` (no copy)."""
    if isinstance(target, ArenaSlot):
        if arena is None:
            raise ValueError("an ArenaSlot needs a back-end built with the arena: CpuCopyBackend(arena=...)")
        target = arena.view(target.offset, target.nbytes)
    try:
        view = memoryview(target)
    except TypeError as exc:
        raise ValueError(
            f"cannot copy {type(target).__name__}: pass an ArenaSlot or a buffer-protocol object "
            "(memoryview, bytearray, numpy array)"
        ) from exc
    if not view.c_contiguous:
        raise ValueError("copy targets must be C-contiguous; call np.ascontiguousarray first")
    if writable and view.readonly:
        raise ValueError("the destination of a copy is read-only")
    return np.frombuffer(view.cast("B"), np.uint8)


class CpuCopyBackend(CopyBackend):
    """Plain memory copies (numpy ``copyto``, which releases the GIL for large copies).

    ``background=False`` (default) copies inside :meth:`copy` and returns a finished job: simplest, and
    on a CPU host the copy competes for the same cores either way. ``background=True`` copies on one
    named thread so the caller can overlap other work.
    """

    name = "cpu"

    def __init__(self, arena: SharedArena | None = None, *, background: bool = False) -> None:
        self._arena = arena
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiercache-cpu-copy") if background else None
        )

    def copy(self, pairs: Sequence[CopyPair]) -> CopyJob:
        """Copy (or queue) the batch. Inline mode costs the memcpy (~5-10 GB/s on this hardware)."""
        arrays = []
        for dst, src in pairs:
            d = _byte_array(dst, self._arena, writable=True)
            s = _byte_array(src, self._arena, writable=False)
            if d.nbytes != s.nbytes:
                raise ValueError(f"copy size mismatch: destination {d.nbytes} bytes, source {s.nbytes}")
            arrays.append((d, s))
        if self._executor is None:
            return _FinishedJob(_copy_arrays(arrays))
        return _FutureJob(self._executor.submit(_copy_arrays, arrays))

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def _copy_arrays(arrays: list[tuple[np.ndarray, np.ndarray]]) -> CopyResult:
    total = 0
    try:
        for d, s in arrays:
            np.copyto(d, s)
            total += d.nbytes
    except Exception as exc:  # reported as a result: the caller may be on another thread
        return CopyResult(False, total, f"{type(exc).__name__}: {exc}")
    return CopyResult(True, total)


# -- CUDA ------------------------------------------------------------------------------------------
class _CudaJob(CopyJob):
    """Completion of a batch on the copy stream, observed through a CUDA event."""

    def __init__(self, event: Any, nbytes: int, keepalive: list[Any]) -> None:
        self.event = event  # a torch.cuda.Event; a consumer stream may wait_event() on it
        self._nbytes = nbytes
        self._keepalive: list[Any] | None = keepalive  # tensors must outlive the async copy
        self._result: CopyResult | None = None

    def done(self) -> bool:
        if self._result is not None:
            return True
        try:
            finished = bool(self.event.query())
        except RuntimeError as exc:
            self._finish(CopyResult(False, 0, f"CUDA error: {exc}"))
            return True
        if finished:
            self._finish(CopyResult(True, self._nbytes))
        return finished

    def wait(self, timeout: float | None = None) -> CopyResult | None:
        if self._result is not None:
            return self._result
        try:
            if timeout is None:
                self.event.synchronize()
            else:
                deadline = time.monotonic() + timeout
                # cudaEventSynchronize has no timeout; poll with a short back-off instead.
                while not self.event.query():
                    if time.monotonic() >= deadline:
                        return None
                    time.sleep(50e-6)
        except RuntimeError as exc:
            self._finish(CopyResult(False, 0, f"CUDA error: {exc}"))
            return self._result
        self._finish(CopyResult(True, self._nbytes))
        return self._result

    def _finish(self, result: CopyResult) -> None:
        self._result = result
        self._keepalive = None


class CudaCopyBackend(CopyBackend):
    """Asynchronous DMA between GPU pages and the arena, on a side stream. One per worker process.

    Construction (once per worker, at start-up) imports torch, pins this process's mapping of the
    arena with ``cudaHostRegister`` (costly: proportional to the arena size) and creates the stream.
    :meth:`copy` only enqueues work: the copy stream first waits for the current stream (so stores read
    KV the forward pass has finished writing), and the job's ``event`` lets a consumer stream wait for
    loads (``torch.cuda.current_stream().wait_event(job.event)``) without blocking the host.
    """

    name = "cuda"

    def __init__(self, arena: SharedArena, *, device: int | str | None = None) -> None:
        try:
            import torch
        except ImportError as exc:
            raise CopyBackendError(
                "the CUDA copy back-end needs torch with CUDA (pip install 'tiercache[cuda]'); on "
                "a host without a GPU use CpuCopyBackend"
            ) from exc
        if not torch.cuda.is_available():
            raise CopyBackendError(
                "the CUDA copy back-end found no CUDA device (torch.cuda.is_available() is False); "
                "use CpuCopyBackend on this host, or check CUDA_VISIBLE_DEVICES and the driver"
            )
        self._torch = torch
        if device is None:
            device = torch.cuda.current_device()
        self._device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        self._arena = arena
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            # Holds a view of the whole mapping: the registration below must not outlive it.
            self._host = torch.frombuffer(arena.view(0, arena.size), dtype=torch.uint8)
        self._ptr = self._host.data_ptr()
        cudart = torch.cuda.cudart()
        try:
            torch.cuda.check_error(cudart.cudaHostRegister(self._ptr, arena.size, 0))
        except Exception as exc:  # torch.cuda.CudaError and friends
            raise CopyBackendError(
                f"cudaHostRegister of L1 arena {arena.name!r} ({arena.size} bytes) failed: {exc}. "
                "Is it already registered by another back-end in this process, or is the locked-"
                "memory limit (ulimit -l) too low?"
            ) from exc
        self._registered = True
        self._stream = torch.cuda.Stream(device=self._device)

    @property
    def host(self) -> Any:
        """The whole arena mapping as a pinned uint8 CPU tensor (slices of it copy asynchronously)."""
        if self._host is None:
            raise CopyBackendError("the CUDA copy back-end is closed")
        return self._host

    @property
    def stream(self) -> Any:
        """This back-end's side stream (``torch.cuda.Stream``); copies on it overlap the compute stream."""
        return self._stream

    def _tensor(self, target: CopyTarget, *, writable: bool) -> Any:
        torch = self._torch
        if isinstance(target, ArenaSlot):
            if target.offset < 0 or target.offset + target.nbytes > self._arena.size:
                raise ValueError(f"{target} is outside the arena of {self._arena.size} bytes")
            return self._host[target.offset : target.offset + target.nbytes]
        if isinstance(target, torch.Tensor):
            if not target.is_contiguous():
                raise ValueError("copy targets must be contiguous tensors; call .contiguous() first")
            return target.view(-1).view(torch.uint8)
        view = memoryview(target)
        if writable and view.readonly:
            raise ValueError("the destination of a copy is read-only")
        with warnings.catch_warnings():
            # torch warns about read-only buffers; sources are only read.
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(view.cast("B"), dtype=torch.uint8)

    def copy(self, pairs: Sequence[CopyPair]) -> CopyJob:
        """Enqueue the batch on the copy stream and return at once. Costs microseconds per pair."""
        torch = self._torch
        tensors = []
        total = 0
        for dst, src in pairs:
            d = self._tensor(dst, writable=True)
            s = self._tensor(src, writable=False)
            if d.numel() != s.numel():
                raise ValueError(f"copy size mismatch: destination {d.numel()} bytes, source {s.numel()}")
            tensors.append((d, s))
            total += d.numel()
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        try:
            with torch.cuda.stream(self._stream):
                for d, s in tensors:
                    d.copy_(s, non_blocking=True)
                for t in (t for pair in tensors for t in pair):
                    if t.is_cuda:
                        # The caching allocator must not reuse these blocks before the copy ran.
                        t.record_stream(self._stream)
                event = torch.cuda.Event()
                event.record(self._stream)
        except RuntimeError as exc:
            return _FinishedJob(CopyResult(False, 0, f"CUDA error while enqueuing copies: {exc}"))
        return _CudaJob(event, total, [t for pair in tensors for t in pair])

    def close(self) -> None:
        """Wait for queued copies, unregister the arena mapping. Idempotent."""
        if not self._registered:
            return
        self._registered = False
        self._stream.synchronize()
        self._torch.cuda.cudart().cudaHostUnregister(self._ptr)
        self._host = None
