"""Page views at manager-block granularity, and the page copy engines, on real (CPU) torch tensors.

The tensors are shaped like vLLM's layer caches: vLLM 0.32's logical ``[B, H, N, C]`` in the
``LBHNC`` (block-contiguous) and ``LHBNC`` (heads outside blocks, as FlashInfer's K and V head slots)
physical orders, and the older FlashAttention ``[2, kernel_blocks, block, heads, head_size]``
(K/V planes first). When a backend splits each manager block into ``k`` kernel blocks, manager
block ``b`` is kernel blocks ``b*k … b*k+k-1``. GPU-only tests are at the end, skipped without CUDA.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="page views need torch (the vLLM environment has it)")

from tiercache.connector.copy import (  # noqa: E402
    CpuPageCopy,
    CudaPageCopy,
    PageCopyEngine,
    select_copy_engine,
)
from tiercache.connector.loads import PageWrite  # noqa: E402
from tiercache.connector.pages import PageView, page_view  # noqa: E402
from tiercache.errors import ConfigError  # noqa: E402
from tiercache.keys.digest import Digest, digest  # noqa: E402

NUM_BLOCKS = 6
K = 4  # kernel blocks per manager block
KERNEL_BLOCK = 4  # tokens
HEADS, HEAD = 2, 8
DTYPE = torch.bfloat16
ES = 2
MANAGER_PAGE = 2 * K * KERNEL_BLOCK * HEADS * HEAD * ES  # K and V of 16 tokens


def load(
    engine: PageCopyEngine,
    pages: list[PageView],
    ids: torch.Tensor,
    srcs: list[torch.Tensor],
    overlap: bool = False,
) -> None:
    """Write ``srcs[layer]`` into blocks ``ids`` of ``pages[layer]`` through the engine's load job."""
    job = engine.start_load(
        [[PageWrite(0, pv, ids, src)] for pv, src in zip(pages, srcs, strict=True)], overlap
    )
    assert job.finish() == set()


def _fill(t: torch.Tensor) -> torch.Tensor:
    """Distinct bytes everywhere, so any misplaced byte shows."""
    flat = t.view(torch.uint8) if t.is_contiguous() else None
    g = torch.Generator().manual_seed(1234)
    if flat is not None:
        flat.copy_(torch.randint(0, 256, flat.shape, generator=g, dtype=torch.uint8))
    else:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return t


def flash_attention_planes() -> tuple[torch.Tensor, PageView]:
    """Older FlashAttention: ``[2, num_kernel_blocks, kernel_block, heads, head_size]``."""
    t = _fill(torch.empty(2, NUM_BLOCKS * K, KERNEL_BLOCK, HEADS, HEAD, dtype=DTYPE))
    return t, page_view("fa", t, page_bytes=MANAGER_PAGE, kernel_blocks=K, block_dim=1)


def lbhnc() -> tuple[torch.Tensor, PageView]:
    """vLLM 0.32 LBHNC split into kernel blocks: ``[B*k, H, N, C]`` contiguous, C = K|V."""
    t = _fill(torch.empty(NUM_BLOCKS * K, HEADS, KERNEL_BLOCK, 2 * HEAD, dtype=DTYPE))
    return t, page_view("lbhnc", t, page_bytes=MANAGER_PAGE, kernel_blocks=K)


def lhbnc() -> tuple[torch.Tensor, PageView]:
    """vLLM 0.32 LHBNC: logical ``[B*k, 2H, N, C]`` stored ``[2H, B*k, N, C]`` (FlashInfer: K heads
    then V heads as head slots)."""
    phys = _fill(torch.empty(2 * HEADS, NUM_BLOCKS * K, KERNEL_BLOCK, HEAD, dtype=DTYPE))
    t = phys.permute(1, 0, 2, 3)
    return t, page_view("lhbnc", t, page_bytes=MANAGER_PAGE, kernel_blocks=K)


LAYOUTS = {"flash-attention-planes": flash_attention_planes, "lbhnc": lbhnc, "lhbnc": lhbnc}


def _expected_page(t: torch.Tensor, layout: str, b: int) -> bytes:
    """Manager block ``b``'s bytes in physical order, written out by hand per layout."""
    kb = slice(b * K, (b + 1) * K)
    if layout == "flash-attention-planes":
        parts = [t[0, kb], t[1, kb]]  # the K run, then the V run
    elif layout == "lbhnc":
        parts = [t[kb]]
    else:
        parts = [t[kb, h] for h in range(2 * HEADS)]  # one run per head slot
    return b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in parts)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_page_is_the_manager_blocks_kernel_blocks_in_physical_order(layout: str) -> None:
    t, pv = LAYOUTS[layout]()
    assert (pv.num_blocks, pv.page_bytes, pv.kernel_blocks) == (NUM_BLOCKS, MANAGER_PAGE, K)
    assert pv.runs == {"flash-attention-planes": 2, "lbhnc": 1, "lhbnc": 2 * HEADS}[layout]
    assert pv.view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()  # a view, no copy
    ids = torch.tensor([3, 1, 5])
    out = torch.empty(3, MANAGER_PAGE, dtype=torch.uint8)
    pv.gather(ids, out)
    for row, b in zip(out, ids.tolist()):
        assert row.numpy().tobytes() == _expected_page(t, layout, b)


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlapped"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_store_then_load_round_trips_exact_bytes_and_never_touches_block_0(
    layout: str, overlap: bool
) -> None:
    src_t, src = LAYOUTS[layout]()
    dst_t, dst = LAYOUTS[layout]()
    dst_t.zero_()
    engine = CpuPageCopy()
    arena = torch.empty(2, 4, MANAGER_PAGE, dtype=torch.uint8)  # [layers, blocks per chunk, page]
    save_ids = torch.tensor([4, 2, 5, 1])
    h = Digest()
    engine.save(engine.save_point(), [src, src], save_ids, list(arena), h)
    # The writer's digest, read from its own pages, is the digest of what the slot received.
    assert h.value == digest(arena.numpy().tobytes())
    load_ids = torch.tensor([3, 5, 1, 2])  # other blocks than the ones saved: pages move as units
    load(engine, [dst, dst], load_ids, list(arena), overlap)
    for s, d in zip(save_ids.tolist(), load_ids.tolist()):
        assert _expected_page(dst_t, layout, d) == _expected_page(src_t, layout, s)
    assert not any(_expected_page(dst_t, layout, 0))  # block 0 (vLLM's null block) untouched
    assert not any(_expected_page(dst_t, layout, 4))


def test_unsplit_block_contiguous_pages_are_the_blocks_bytes_as_before() -> None:
    """The CPU backend's layout (no split): a page is ``tensor[b]``'s bytes, what the connector
    always stored, so objects written before page views stay valid."""
    t = _fill(torch.empty(5, HEADS, 16, 2 * HEAD, dtype=DTYPE))
    pv = page_view("cpu", t, page_bytes=t[0].numel() * ES, kernel_blocks=1)
    out = torch.empty(1, pv.page_bytes, dtype=torch.uint8)
    pv.gather(torch.tensor([3]), out)
    assert out[0].numpy().tobytes() == t[3].contiguous().view(torch.uint8).numpy().tobytes()
    assert pv.runs == 1


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"page_bytes": MANAGER_PAGE // 2, "kernel_blocks": K}, "the KV-cache spec says"),
        (
            {"page_bytes": MANAGER_PAGE // K, "kernel_blocks": 1},
            "the KV-cache spec says",
        ),  # split not derived
        ({"page_bytes": MANAGER_PAGE, "kernel_blocks": 5}, "not a multiple of 5 kernel blocks"),
    ],
)
def test_shapes_that_do_not_match_the_spec_are_refused_clearly(kwargs: dict[str, int], words: str) -> None:
    t = torch.zeros(NUM_BLOCKS * K, HEADS, KERNEL_BLOCK, 2 * HEAD, dtype=DTYPE)
    if kwargs["kernel_blocks"] == 1:
        kwargs["page_bytes"] = MANAGER_PAGE  # a manager page, but the tensor counts kernel blocks
    with pytest.raises(ConfigError, match=words) as err:
        page_view("layer.7", t, **kwargs)
    assert "layer.7" in str(err.value) and "not supported" in str(err.value)


def test_tensors_whose_blocks_overlap_are_refused() -> None:
    overlapping = torch.zeros(64, dtype=DTYPE).as_strided((8, 4), (2, 1))  # blocks share elements
    with pytest.raises(ConfigError, match="overlapping=True"):
        page_view("x", overlapping, page_bytes=4 * ES, kernel_blocks=1)


def test_a_page_with_gaps_between_its_elements_is_many_runs() -> None:
    backing = _fill(torch.empty(8, 4, 2, dtype=DTYPE))
    pv = page_view("y", backing[:, :, 0], page_bytes=4 * ES, kernel_blocks=1)
    assert pv.runs == 4
    out = torch.empty(1, 4 * ES, dtype=torch.uint8)
    pv.gather(torch.tensor([6]), out)
    assert torch.equal(out[0].view(DTYPE), backing[6, :, 0])


def test_manifests_with_other_kernel_blocks_have_other_fingerprints() -> None:
    from tiercache.keys import GroupKind, LayoutManifest

    def manifest(kernel: int) -> LayoutManifest:
        return LayoutManifest(
            model_id="m",
            model_revision="r",
            kv_dtype="bfloat16",
            attention_backend="FLASH_ATTN",
            kv_layout="LBHNC",
            kernel_block_size=kernel,
            manager_block_size=64,
            page_bytes=MANAGER_PAGE,
            page_bytes_unpadded=MANAGER_PAGE,
            group_kind=GroupKind.FULL_ATTENTION,
            chunk_size=256,
            num_layers=2,
        )

    assert manifest(16).fingerprint() != manifest(64).fingerprint()


def test_verify_kv_caches_builds_views_with_the_manifests_split() -> None:
    from tiercache.connector.layout import GroupLayout, verify_kv_caches
    from tiercache.keys import GroupKind, LayoutManifest

    m = LayoutManifest(
        model_id="m",
        model_revision="r",
        kv_dtype="bfloat16",
        attention_backend="FLASH_ATTN",
        kv_layout="LBHNC",
        kernel_block_size=KERNEL_BLOCK,
        manager_block_size=K * KERNEL_BLOCK,
        page_bytes=MANAGER_PAGE,
        page_bytes_unpadded=MANAGER_PAGE,
        group_kind=GroupKind.FULL_ATTENTION,
        chunk_size=64,
        num_layers=2,
    )
    g = GroupLayout(0, 0, 0, ("a", "b"), K * KERNEL_BLOCK, 4, MANAGER_PAGE, m)
    caches = {n: lbhnc()[0] for n in ("a", "b")}
    pages = verify_kv_caches([g], caches, None)
    assert [(p.layer, p.kernel_blocks, p.num_blocks) for p in pages[0]] == [
        ("a", K, NUM_BLOCKS),
        ("b", K, NUM_BLOCKS),
    ]
    with pytest.raises(ConfigError, match="layer b has no KV tensor"):
        verify_kv_caches([g], {"a": caches["a"]}, None)


# -- engine selection ------------------------------------------------------------------------------


def test_cpu_tensors_select_the_cpu_engine() -> None:
    assert isinstance(select_copy_engine([torch.zeros(2), torch.zeros(3)]), CpuPageCopy)


def test_mixed_or_missing_devices_are_refused() -> None:
    with pytest.raises(ConfigError, match="no KV tensors"):
        select_copy_engine([])
    with pytest.raises(ConfigError, match="only cpu and cuda"):
        select_copy_engine([torch.zeros(2, device="meta")])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on hosts without CUDA")
def test_the_cuda_engine_without_cuda_says_what_to_check() -> None:
    from tiercache.errors import CopyBackendError

    with pytest.raises(CopyBackendError, match="CUDA_VISIBLE_DEVICES"):
        CudaPageCopy(torch.device("cuda", 0))


# -- CUDA (skipped without a GPU) ------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CUDA copy path)")


@pytest.fixture
def cuda_arena():  # type: ignore[no-untyped-def]
    from tiercache.l1.arena import SharedArena

    arena = SharedArena.create(None, 8 << 20)
    try:
        yield arena
    finally:
        arena.close()
        arena.unlink()


@needs_cuda
def test_cuda_tensors_select_the_cuda_engine() -> None:
    engine = select_copy_engine([torch.zeros(2, device="cuda")])
    assert isinstance(engine, CudaPageCopy)
    engine.close()


@needs_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_store_then_load_round_trips_through_the_pinned_arena(layout: str, cuda_arena) -> None:  # type: ignore[no-untyped-def]
    cpu_t, _ = LAYOUTS[layout]()
    src_t = cpu_t.cuda()
    block_dim = 1 if layout == "flash-attention-planes" else 0
    if layout == "lhbnc":  # keep the physical order on the device
        src_t = cpu_t.permute(1, 0, 2, 3).contiguous().cuda().permute(1, 0, 2, 3)
    src = page_view("s", src_t, page_bytes=MANAGER_PAGE, kernel_blocks=K, block_dim=block_dim)
    dst_t = torch.zeros_like(src_t)
    dst = page_view("d", dst_t, page_bytes=MANAGER_PAGE, kernel_blocks=K, block_dim=block_dim)
    engine = CudaPageCopy(src_t.device)
    engine.attach(cuda_arena)
    try:
        host = engine.host(cuda_arena, 4096, 2 * 3 * MANAGER_PAGE).view(2, 3, MANAGER_PAGE)
        assert host.is_pinned()
        save_ids, load_ids = torch.tensor([5, 1, 3]), torch.tensor([2, 4, 1])
        engine.save(engine.save_point(), [src, src], save_ids, list(host))
        load(engine, [dst, dst], load_ids, list(host))
        torch.cuda.current_stream().synchronize()
        out_t = dst_t.cpu()
        for s, d in zip(save_ids.tolist(), load_ids.tolist()):
            assert _expected_page(out_t, layout, d) == _expected_page(cpu_t, layout, s)
        assert not any(_expected_page(out_t, layout, 0))
    finally:
        engine.close()


@needs_cuda
def test_cuda_save_reads_what_the_compute_stream_wrote_before_the_save_point(cuda_arena) -> None:  # type: ignore[no-untyped-def]
    """Ordering: a kernel still running on the compute stream when the save is queued must finish
    before the side stream reads the blocks."""
    t = torch.zeros(NUM_BLOCKS * K, HEADS, KERNEL_BLOCK, 2 * HEAD, dtype=DTYPE, device="cuda")
    pv = page_view("l", t, page_bytes=MANAGER_PAGE, kernel_blocks=K)
    engine = CudaPageCopy(t.device)
    engine.attach(cuda_arena)
    try:
        torch.cuda._sleep(50_000_000)  # keep the compute stream busy (~tens of ms)
        t.fill_(3.0)  # queued behind the sleep
        ready = engine.save_point()
        host = engine.host(cuda_arena, 0, MANAGER_PAGE).view(1, MANAGER_PAGE)
        engine.save(ready, [pv], torch.tensor([2]), [host])
        expected = (
            torch.full((K, HEADS, KERNEL_BLOCK, 2 * HEAD), 3.0, dtype=DTYPE).view(torch.uint8).flatten()
        )
        assert torch.equal(host[0], expected)
    finally:
        engine.close()


@needs_cuda
def test_cuda_load_is_visible_to_the_compute_stream(cuda_arena) -> None:  # type: ignore[no-untyped-def]
    t = torch.zeros(NUM_BLOCKS * K, HEADS, KERNEL_BLOCK, 2 * HEAD, dtype=DTYPE, device="cuda")
    pv = page_view("l", t, page_bytes=MANAGER_PAGE, kernel_blocks=K)
    engine = CudaPageCopy(t.device)
    engine.attach(cuda_arena)
    try:
        host = engine.host(cuda_arena, 0, MANAGER_PAGE).view(1, MANAGER_PAGE)
        host.copy_(torch.full((MANAGER_PAGE // ES,), 7.0, dtype=DTYPE).view(torch.uint8))
        job = engine.start_load([[PageWrite(0, pv, torch.tensor([3]), host)]], overlap=False)
        total = t[3 * K : 4 * K].float().sum()  # runs on the compute stream, after the load's event
        assert job.finish() == set()
        assert total.item() == 7.0 * MANAGER_PAGE // ES
        assert t[: 3 * K].abs().sum().item() == 0
    finally:
        engine.close()


@needs_cuda
def test_cuda_overlapped_load_is_visible_to_the_compute_stream_after_wait_layer(cuda_arena) -> None:  # type: ignore[no-untyped-def]
    """With overlap, each layer's pages are ordered before the compute stream's later work only by
    ``wait_layer`` (vLLM's ``wait_for_layer_load``), layer by layer."""
    ts = [
        torch.zeros(NUM_BLOCKS * K, HEADS, KERNEL_BLOCK, 2 * HEAD, dtype=DTYPE, device="cuda")
        for _ in range(3)
    ]
    pvs = [page_view(f"l{i}", t, page_bytes=MANAGER_PAGE, kernel_blocks=K) for i, t in enumerate(ts)]
    engine = CudaPageCopy(ts[0].device)
    engine.attach(cuda_arena)
    try:
        host = engine.host(cuda_arena, 0, 3 * MANAGER_PAGE).view(3, 1, MANAGER_PAGE)
        for i in range(3):
            host[i].copy_(torch.full((MANAGER_PAGE // ES,), float(i + 1), dtype=DTYPE).view(torch.uint8))
        job = engine.start_load(
            [[PageWrite(0, pv, torch.tensor([2]), host[i])] for i, pv in enumerate(pvs)], overlap=True
        )
        totals = []
        for i, t in enumerate(ts):
            job.wait_layer(i)
            totals.append(t[2 * K : 3 * K].float().sum())
        assert job.finish() == set()
        assert [x.item() for x in totals] == [float(i + 1) * MANAGER_PAGE // ES for i in range(3)]
    finally:
        engine.close()


@pytest.mark.parametrize("ids", [[1, 2, 3, 4, 5], [5, 4, 3], [2, 3, 1, 4, 5], [3]])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_out_writes_what_gather_writes_and_digests_exactly_those_bytes(
    layout: str, ids: list[int]
) -> None:
    # A store hashes and copies its pages a piece at a time (two pages here, so runs split): the
    # slot must get gather's bytes and the digest must be theirs, whatever the runs of block ids.
    _, pv = LAYOUTS[layout]()
    ref = torch.empty(len(ids), MANAGER_PAGE, dtype=torch.uint8)
    pv.gather(torch.tensor(ids), ref)
    got = torch.zeros(len(ids), MANAGER_PAGE, dtype=torch.uint8)
    h = Digest()
    pv.copy_out(h, ids, got, piece_bytes=2 * MANAGER_PAGE)
    assert torch.equal(got, ref)
    assert h.value == digest(ref.numpy().tobytes())


@pytest.mark.parametrize("load_ids", [[1, 2, 3, 4], [4, 3, 2, 1], [1, 2, 4, 5], [5, 1, 2, 3]])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scatter_writes_the_same_bytes_as_index_copy_whatever_the_runs_of_block_ids(
    layout: str, load_ids: list[int]
) -> None:
    # scatter copies runs of consecutive ids as slices (fast on CPU); the result must be exactly
    # what a plain index_copy_ of the same pages gives.
    _, src = LAYOUTS[layout]()
    ref_t, ref = LAYOUTS[layout]()
    got_t, got = LAYOUTS[layout]()
    ref_t.zero_()
    got_t.zero_()
    rows = torch.empty(4, MANAGER_PAGE, dtype=torch.uint8)
    src.gather(torch.tensor([1, 2, 3, 4]), rows)
    ids = torch.tensor(load_ids)
    ref.view.index_copy_(0, ids, rows.view(4, *ref.view.shape[1:]))
    got.scatter(ids, rows)
    assert torch.equal(got.view, ref.view)  # as bytes: random bf16 bytes include NaNs
