"""What a tier's copy of an object costs the other threads of the server: copy_into against a
memoryview slice assignment, measured in the same run.

A promotion copies each object from disk into L1 on a promotion thread while the request loop and
the I/O threads answer other clients. Prints, for objects of ``--mib`` MiB copied back to back on
``--threads`` threads, how late a sleeping thread wakes (p50, p99: what a lookup's reply waits for
the GIL), and the copy's own time per object, for ``tiercache.tier.copying.copy_into`` and for the
plain slice assignment it replaces.

    python benchmarks/copy_gil.py [--mib 2] [--threads 2] [--wakeups 400]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

from tiercache.tier.copying import copy_into

Copy = Callable[[memoryview, bytes], None]


def _slice(dst: memoryview, src: bytes) -> None:
    dst[:] = src


def wakeup_lag_ms(copy: Copy, nbytes: int, threads: int, wakeups: int) -> list[float]:
    """How late a 0.2 ms sleep ends, in ms, while ``threads`` threads copy ``nbytes`` objects."""
    stop = threading.Event()

    def copier() -> None:
        src, dst = bytes(nbytes), memoryview(bytearray(nbytes))
        while not stop.is_set():
            copy(dst, src)

    workers = [threading.Thread(target=copier) for _ in range(threads)]
    for w in workers:
        w.start()
    lags = []
    try:
        for _ in range(wakeups):
            t0 = time.perf_counter()
            time.sleep(0.0002)
            lags.append((time.perf_counter() - t0 - 0.0002) * 1e3)
    finally:
        stop.set()
        for w in workers:
            w.join()
    return sorted(lags)


def copy_us(copy: Copy, nbytes: int, n: int = 300) -> float:
    """Median microseconds of one copy of ``nbytes`` (one thread, nothing else running)."""
    src, dst = bytes(nbytes), memoryview(bytearray(nbytes))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        copy(dst, src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--mib", type=float, default=2.0, help="object size (a 128-token chunk of the serving benchmark: 2)"
    )
    ap.add_argument(
        "--threads", type=int, default=2, help="copying threads (the server's promotions run on 4)"
    )
    ap.add_argument("--wakeups", type=int, default=400)
    args = ap.parse_args()
    nbytes = int(args.mib * (1 << 20))
    rows = {}
    for name, copy in (("slice assignment", _slice), ("copy_into", copy_into)):
        lags = wakeup_lag_ms(copy, nbytes, args.threads, args.wakeups)
        p99 = lags[min(len(lags) - 1, int(len(lags) * 0.99))]
        rows[name] = (statistics.median(lags), p99, copy_us(copy, nbytes))
    print(f"{args.mib:g} MiB objects, {args.threads} copying threads, {args.wakeups} wake-ups each")
    print("| copy | wake-up lag p50 ms | p99 ms | one copy µs |")
    print("|---|---|---|---|")
    for name, (p50, p99, us) in rows.items():
        print(f"| {name} | {p50:.2f} | {p99:.2f} | {us:.1f} |")
    base, ours = rows["slice assignment"], rows["copy_into"]
    print(f"copy_into ÷ slice: wake-up lag p50 {ours[0] / base[0]:.3f}×, one copy {ours[2] / base[2]:.2f}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
