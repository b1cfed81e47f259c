"""Throughput of the connector's CUDA save/load path vs a raw pinned ``copy_`` of the same bytes.

Runs only where CUDA exists (prints a line and exits 0 elsewhere). For each page size (256 KiB to
4 MiB) it builds a vLLM-0.32-shaped layer cache split into kernel blocks (manager block = ``k``
kernel blocks), a shared L1 arena registered as pinned memory, and measures:

* ``save``: ``CudaPageCopy.save`` (gather of arbitrary block ids on the GPU + device→host DMA into
  the arena on the side stream, waited for) — what the connector's store thread does per chunk;
* ``load``: ``CudaPageCopy.start_load`` of one chunk's plan and its ``finish`` (host→device DMA from
  the arena + scatter into the blocks, one event per layer, waited for);
* ``raw``: one ``copy_(non_blocking=True)`` of the same number of bytes between a contiguous device
  tensor and a ``pin_memory()`` host tensor, each direction.

and prints GB/s and the ratio connector / raw (1.0 = no overhead over the DMA itself).

    python benchmarks/cuda_copy.py [--layers 4] [--blocks-per-chunk 16] [--iters 20]
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="layers per object (default 4)")
    parser.add_argument(
        "--blocks-per-chunk", type=int, default=16, help="pages per layer per chunk (default 16)"
    )
    parser.add_argument(
        "--kernel-split", type=int, default=4, help="kernel blocks per manager block (default 4)"
    )
    parser.add_argument("--iters", type=int, default=20, help="timed repetitions per size (default 20)")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("cuda_copy: torch is not installed; nothing to measure (skipped)")
        return 0
    if not torch.cuda.is_available():
        print("cuda_copy: no CUDA device (torch.cuda.is_available() is False); nothing to measure (skipped)")
        return 0

    dev = torch.device("cuda", torch.cuda.current_device())
    k, bpc, layers = args.kernel_split, args.blocks_per_chunk, args.layers
    print(
        f"cuda_copy on {torch.cuda.get_device_name(dev)}: {layers} layers x {bpc} pages per chunk, "
        f"{k} kernel blocks per page, {args.iters} iterations"
    )
    print(
        f"{'page':>9} {'chunk':>9} {'save GB/s':>10} {'raw d2h':>9} {'ratio':>6} {'load GB/s':>10} {'raw h2d':>9} {'ratio':>6}"
    )
    for page in (256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20):
        r = _measure(dev, page, k, bpc, layers, args.iters)
        print(
            f"{page >> 10:>6} KiB {layers * bpc * page >> 20:>6} MiB {r['save']:>10.2f} {r['d2h']:>9.2f} "
            f"{r['save'] / r['d2h']:>6.2f} {r['load']:>10.2f} {r['h2d']:>9.2f} {r['load'] / r['h2d']:>6.2f}"
        )
    return 0


def _measure(dev, page: int, k: int, bpc: int, layers: int, iters: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """GB/s of the connector's save and load and of raw pinned copies, for one page size."""
    import torch

    from tiercache.connector.copy import CudaPageCopy
    from tiercache.connector.loads import PageWrite
    from tiercache.connector.pages import page_view
    from tiercache.keys.digest import Digest
    from tiercache.l1.arena import SharedArena

    heads, content = 8, 2 * 128 * 2  # 8 KV heads, K|V of head size 128 in bf16, per token
    tokens_per_kernel_block = page // k // (heads * content)
    num_blocks = 4 * bpc + 1
    caches = [
        torch.randint(
            -100,
            100,
            (num_blocks * k, heads, tokens_per_kernel_block, content // 2),
            dtype=torch.int16,
            device=dev,
        )
        for _ in range(layers)
    ]
    views = [page_view(f"l{i}", c, page_bytes=page, kernel_blocks=k) for i, c in enumerate(caches)]
    chunk = layers * bpc * page
    arena = SharedArena.create(None, chunk)
    engine = CudaPageCopy(dev)
    try:
        engine.attach(arena)
        host = list(engine.host(arena, 0, chunk).view(layers, bpc, page))
        ids = torch.randperm(num_blocks - 1)[:bpc] + 1  # arbitrary blocks, never block 0
        raw_dev = torch.empty(chunk, dtype=torch.uint8, device=dev)
        raw_host = torch.empty(chunk, dtype=torch.uint8).pin_memory()

        def save() -> None:
            engine.save(engine.save_point(), views, ids, host, Digest())

        plan = [[PageWrite(0, pv, ids, src)] for pv, src in zip(views, host, strict=True)]

        def load() -> None:
            engine.start_load(plan, overlap=False).finish()

        def d2h() -> None:
            raw_host.copy_(raw_dev, non_blocking=True)
            torch.cuda.synchronize(dev)

        def h2d() -> None:
            raw_dev.copy_(raw_host, non_blocking=True)
            torch.cuda.synchronize(dev)

        return {
            name: _rate(fn, chunk, iters, dev)
            for name, fn in (("save", save), ("d2h", d2h), ("load", load), ("h2d", h2d))
        }
    finally:
        engine.close()
        arena.close()
        arena.unlink()


def _rate(fn, nbytes: int, iters: int, dev) -> float:  # type: ignore[no-untyped-def]
    """GB/s of ``fn`` (which moves ``nbytes`` and returns once they landed), after two warm-ups."""
    import torch

    for _ in range(2):
        fn()
    torch.cuda.synchronize(dev)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize(dev)
    return nbytes * iters / (time.perf_counter() - start) / 1e9


if __name__ == "__main__":
    sys.exit(main())
