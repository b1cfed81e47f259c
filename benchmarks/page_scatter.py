"""Writing loaded pages into a KV tensor on CPU: ``index_copy_`` on byte views against slice copies.

The connector's worker writes each loaded chunk into its blocks' pages (``PageView.scatter``). On CPU
tensors ``index_copy_`` of a ``uint8`` view moves element by element; this measures, on pages of
``--page-kib`` KiB written to ``--pages`` consecutive block ids of a float32 KV tensor:

* ``index_copy_`` of a ``uint8`` view, and the same followed by ``index_select`` (the read back);
* ``index_copy_`` of an ``int64`` view of the same bytes;
* a slice ``copy_`` of the same bytes (memcpy);
* ``PageView.scatter`` as shipped (slice copies for runs of consecutive ids on CPU).

Median of ``--iters`` timed repetitions after one warm-up, in µs, and each case ÷ the slice copy.
Needs torch (the vLLM venv)::

    .venv-vllm/bin/python benchmarks/page_scatter.py [--pages 8] [--page-kib 64] [--iters 200]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    """Print one line a case; 0, or 2 without torch."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--pages", type=int, default=8, help="pages (consecutive block ids) written per call")
    ap.add_argument("--page-kib", type=int, default=64, help="KiB per page")
    ap.add_argument("--blocks", type=int, default=64, help="blocks in the KV tensor")
    ap.add_argument("--iters", type=int, default=200, help="timed repetitions per case")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("page_scatter: needs torch (run it with .venv-vllm/bin/python)", file=sys.stderr)
        return 2
    from benchmarks.hashing import timed_us  # median µs over repeats, after one untimed call
    from tiercache.connector.pages import page_view

    torch.set_num_threads(1)
    page_bytes = args.page_kib * 1024
    kv = torch.zeros(args.blocks, page_bytes // 4, dtype=torch.float32)
    src = torch.randint(0, 256, (args.pages, page_bytes), dtype=torch.uint8)
    ids = torch.arange(3, 3 + args.pages)
    u8 = kv.view(torch.uint8)
    i64, src64 = kv.view(torch.int64), src.view(torch.int64)
    view = page_view("layer", kv, page_bytes=page_bytes, kernel_blocks=1)
    first = int(ids[0])

    def round_trip() -> None:
        u8.index_copy_(0, ids, src)
        u8.index_select(0, ids)

    cases: list[tuple[str, Callable[[], object]]] = [
        ("index_copy_ uint8 view", lambda: u8.index_copy_(0, ids, src)),
        ("index_copy_ + index_select uint8 view", round_trip),
        ("index_copy_ int64 view", lambda: i64.index_copy_(0, ids, src64)),
        ("slice copy_ (baseline)", lambda: u8[first : first + args.pages].copy_(src)),
        ("PageView.scatter (as shipped)", lambda: view.scatter(ids, src)),
    ]
    results = [(name, timed_us(fn, args.iters)) for name, fn in cases]
    base = dict(results)["slice copy_ (baseline)"]
    print(
        f"{args.pages} pages of {args.page_kib} KiB into a {args.blocks}-block float32 tensor, torch "
        f"{torch.__version__}, 1 thread, median of {args.iters}:"
    )
    for name, us in results:
        print(f"  {name:40s} {us:9.1f} µs  {us / base:6.1f}× slice copy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
