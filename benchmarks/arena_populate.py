"""The L1 arena's first touch: a copy into a mapping whose pages are not mapped yet, against the same
copy into a mapping populated ahead (``SharedArena.populate``) and against a copy into pages mapped
before (the baseline, measured in the same run).

Each process maps a page of ``/dev/shm`` only at its first access, one fault per 4 KiB page. The
server creates the arena and populates its own mapping on a background thread at start-up, and so
does every client that maps it; this shows what that moves off the copies. Three arenas of
``--gib`` each, one after another:

* ``owner, fresh``: the creating process writes every byte once (as a server's first promotions
  would without populating), then once more (``warm``: the baseline);
* ``attached, fresh``: a second mapping of an arena written before, as a client's first copies;
* ``attached, populated``: a second mapping populated first (its time printed apart), then written.

    python benchmarks/arena_populate.py [--gib 1]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from tiercache.l1.arena import SharedArena

STEP = 64 << 20


def write_all(arena: SharedArena, src: np.ndarray) -> float:
    """Seconds to write every byte of ``arena`` through this mapping, ``len(src)`` bytes a copy."""
    t0 = time.perf_counter()
    for start in range(0, arena.size, len(src)):
        n = min(len(src), arena.size - start)
        np.frombuffer(arena.view(start, n), dtype=np.uint8)[:] = src[:n]
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="arena size in GiB (default 1)")
    args = parser.parse_args()
    size = int(args.gib * 2**30)
    src = np.full(STEP, 7, dtype=np.uint8)
    rows: list[tuple[str, float]] = []
    with SharedArena.create(None, size) as owner:
        rows.append(("owner, fresh", write_all(owner, src)))
        warm = write_all(owner, src)
        rows.append(("owner, warm (baseline)", warm))
        owner.unlink()
    with SharedArena.create(None, size) as owner:
        write_all(owner, src)
        other = SharedArena.attach(owner.name)
        rows.append(("attached, fresh", write_all(other, src)))
        other.close()
        other = SharedArena.attach(owner.name)
        t0 = time.perf_counter()
        populated = other.populate()
        populate_s = time.perf_counter() - t0
        rows.append(("attached, populated", write_all(other, src)))
        other.close()
        owner.unlink()
    with SharedArena.create(None, size) as owner:
        t0 = time.perf_counter()
        populated = populated and owner.populate()
        owner_populate_s = time.perf_counter() - t0
        rows.append(("owner, populated", write_all(owner, src)))
        owner.unlink()
    print(f"arena of {size / 2**30:.2f} GiB, written {STEP >> 20} MiB a copy")
    print(f"{'':24} {'GB/s':>7} {'time / warm':>12}")
    for name, seconds in rows:
        print(f"{name:24} {size / seconds / 1e9:7.2f} {seconds / warm:11.2f}x")
    print(
        f"populate ({'done' if populated else 'NOT done: kernel before 5.14?'}): owner {owner_populate_s:.2f} s, "
        f"attached {populate_s:.2f} s ({size / populate_s / 1e9:.2f} GB/s of arena), off the copies on a "
        "background thread in the server and the clients"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
