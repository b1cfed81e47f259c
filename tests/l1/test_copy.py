"""Copy back-ends: pages move between engine memory and arena slots byte for byte."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import make_key, payload_for
from tiercache.errors import CopyBackendError
from tiercache.l1.arena import ArenaSlot
from tiercache.l1.copy import CopyResult, CpuCopyBackend, CudaCopyBackend


def test_importing_l1_does_not_import_torch() -> None:
    code = "import sys, tiercache.l1; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# -- CPU ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
def test_cpu_backend_stores_pages_into_slots_and_loads_them_back(make_l1, background: bool) -> None:
    tier = make_l1(size_bytes=256 * 1024)
    pages = [np.arange(i, i + 2048, dtype=np.float32) for i in range(3)]  # engine "KV pages"
    handles = [tier.reserve(make_key(i), p.nbytes) for i, p in enumerate(pages)]
    with CpuCopyBackend(tier.arena, background=background) as backend:
        store = backend.copy([(tier.slot_of(h), p) for h, p in zip(handles, pages)])
        assert store.wait() == CopyResult(True, sum(p.nbytes for p in pages))
        for h in handles:
            tier.commit(h)

        restored = [np.zeros_like(p) for p in pages]
        leases = [tier.pin(make_key(i)) for i in range(3)]
        load = backend.copy([(r, tier.slot_of(h)) for r, h in zip(restored, leases)])
        result = load.wait(timeout=30)
        assert result is not None and result.success and load.done()
        for h in leases:
            tier.release(h)
    for r, p in zip(restored, pages):
        np.testing.assert_array_equal(r, p)


def test_cpu_backend_copies_between_any_buffers() -> None:
    src = bytearray(payload_for(make_key(1), 5000))
    dst_view = memoryview(bytearray(5000))
    dst_array = np.empty((50, 100), dtype=np.uint8)
    job = CpuCopyBackend().copy([(dst_view, src), (dst_array, memoryview(src).toreadonly())])
    assert job.done() and job.wait().success
    assert bytes(dst_view) == bytes(src)
    assert dst_array.tobytes() == bytes(src)


def test_cpu_backend_refuses_mismatched_sizes_before_copying() -> None:
    dst = bytearray(10)
    with pytest.raises(ValueError, match="size mismatch"):
        CpuCopyBackend().copy([(dst, b"abc")])
    assert dst == bytearray(10)


def test_cpu_backend_refuses_a_read_only_destination() -> None:
    with pytest.raises(ValueError, match="read-only"):
        CpuCopyBackend().copy([(b"abc", bytearray(3))])


def test_cpu_backend_needs_the_arena_to_resolve_slots() -> None:
    with pytest.raises(ValueError, match="needs a back-end built with the arena"):
        CpuCopyBackend().copy([(ArenaSlot(0, 3), b"abc")])


# -- CUDA --------------------------------------------------------------------------------------------
def _cuda_or_skip():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this host")
    return torch


def test_cuda_backend_without_torch_or_a_gpu_explains_the_alternative(make_l1) -> None:
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        pytest.skip("this host has a GPU; the error path cannot be reached")
    with pytest.raises(CopyBackendError, match="CpuCopyBackend"):
        CudaCopyBackend(make_l1().arena)


@pytest.mark.gpu
def test_cuda_backend_round_trips_gpu_pages_through_the_arena(make_l1) -> None:
    torch = _cuda_or_skip()
    tier = make_l1(size_bytes=8 << 20)
    pages = [torch.randn(64, 1024, device="cuda", dtype=torch.float16) for _ in range(4)]
    handles = [tier.reserve(make_key(i), p.numel() * p.element_size()) for i, p in enumerate(pages)]
    backend = CudaCopyBackend(tier.arena)
    try:
        store = backend.copy([(tier.slot_of(h), p) for h, p in zip(handles, pages)])
        assert store.wait().success
        for h in handles:
            tier.commit(h)
        for i, p in enumerate(pages):
            assert tier.get(make_key(i)) == p.cpu().numpy().tobytes()

        restored = [torch.zeros_like(p) for p in pages]
        leases = [tier.pin(make_key(i)) for i in range(4)]
        load = backend.copy([(r, tier.slot_of(h)) for r, h in zip(restored, leases)])
        torch.cuda.current_stream().wait_event(load.event)  # consumers order on the event
        assert load.wait(timeout=60).success and load.done()
        for h in leases:
            tier.release(h)
        for r, p in zip(restored, pages):
            assert torch.equal(r, p)
    finally:
        backend.close()


@pytest.mark.gpu
def test_cuda_backend_orders_stores_after_the_compute_stream(make_l1) -> None:
    torch = _cuda_or_skip()
    tier = make_l1(size_bytes=1 << 20)
    backend = CudaCopyBackend(tier.arena)
    try:
        page = torch.zeros(1 << 16, device="cuda", dtype=torch.float32)
        handle = tier.reserve(make_key(0), page.numel() * 4)
        page.fill_(7.0)  # still queued on the current stream when the copy is enqueued
        assert backend.copy([(tier.slot_of(handle), page)]).wait().success
        tier.commit(handle)
        assert np.all(np.frombuffer(tier.get(make_key(0)), dtype=np.float32) == 7.0)
    finally:
        backend.close()
