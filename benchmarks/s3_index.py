"""Benchmark the S3 tier's capacity index as the bucket grows: memory per object, and the time to
merge a listing of the prefix (not run in CI).

Every node keeps an index of every chunk object under the prefix (what the capacity bound evicts
from, :mod:`tiercache.l3_s3.capacity`). For each size in ``--sizes`` this builds a listing of that
many objects (synthetic: random keys in name order, times and sizes, as the prefix's listing returns
them),
merges it into an empty index as the start-up listing is merged, then merges a relisting of it in
which 1% of the objects were deleted and 1% written by other nodes, and prints:

* bytes per object: the index's columns, and everything the merge left allocated (``tracemalloc``),
  and the merge's peak;
* the CPU seconds of the start-up merge and of the relisting's;
* per operation: a write (``set``), a membership test, an eviction of 1,000 objects;
* the baseline measured in the same run, up to ``--baseline-max`` objects: the same listing as a
  plain dict of key → (time, size) and the list of keys oldest first, what a straightforward
  Python index holds, with its bytes per object, its build time and the ratios.

With ``--moto-max N`` it also starts moto's S3 server on 127.0.0.1, writes N objects under a
prefix and times a tier's start-up listing and merge against a raw boto3 listing of the same
prefix. ``--png FILE`` draws bytes per object and merge seconds against the objects.

Usage::

    python benchmarks/s3_index.py [--sizes 10000,100000,1000000,10000000] [--baseline-max 1000000]
                                  [--moto-max 20000] [--png docs/img/s3_index.png]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import tracemalloc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks.serve_figure import MISSING
from tiercache.keys import Fingerprint, ObjectKey
from tiercache.keys.object_key import KEY_BYTES
from tiercache.l3_s3.capacity import CapacityIndex, Listing, rebuild

FINGERPRINT = Fingerprint(bytes(range(16)))
HEAD = ObjectKey(FINGERPRINT, 0, bytes(16)).raw[: KEY_BYTES - 16]  # version, fingerprint, group
NOW = 1_790_000_000.0


def synthetic(n: int, seed: int) -> tuple[bytes, np.ndarray, np.ndarray]:
    """``n`` packed keys (one fingerprint, random prefix hashes) in the order S3 lists them, times
    over a day, ~2 MiB sizes."""
    rng = np.random.default_rng(seed)
    hashes = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    keys = np.empty((n, KEY_BYTES), dtype=np.uint8)
    keys[:, : KEY_BYTES - 16] = np.frombuffer(HEAD, dtype=np.uint8)
    keys[:, KEY_BYTES - 16 :] = hashes
    keys = keys[np.argsort(keys.view(f"V{KEY_BYTES}").ravel(), kind="stable")]  # S3 lists in name order
    mtimes = NOW - rng.uniform(0, 86_400, n)
    sizes = rng.integers(1 << 20, 3 << 20, n).astype(np.uint64)
    return keys.tobytes(), mtimes, sizes


def measured(fn: Callable[[], Any]) -> tuple[Any, float, int]:
    """``fn()``'s result, its CPU seconds and its peak of new allocations (bytes)."""
    gc.collect()
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    began = time.process_time()
    out = fn()
    took = time.process_time() - began
    return out, took, tracemalloc.get_traced_memory()[1] - before


def merge(index: CapacityIndex, listing: Listing | None, drop: bool) -> tuple[int, int]:
    index.begin_rebuild()
    rebuilt = rebuild(index.freeze(), listing, drop_unlisted=drop)
    index.install(rebuilt)
    return rebuilt.added, rebuilt.dropped


def one_size(n: int, baseline_max: int) -> dict[str, Any]:
    keys, mtimes, sizes = synthetic(n, seed=n)
    listing = Listing.packed(keys, mtimes, sizes)
    gc.collect()
    held_before = tracemalloc.get_traced_memory()[0]
    index = CapacityIndex(clock=lambda: NOW)
    _, merge_s, merge_peak = measured(lambda: merge(index, listing, False))
    held = tracemalloc.get_traced_memory()[0] - held_before  # the index, after the merge

    # A relisting: 1% deleted by other nodes, 1% written by them.
    k = max(1, n // 100)
    more_keys, more_mtimes, more_sizes = synthetic(k, seed=n + 1)
    both = np.frombuffer(keys[k * KEY_BYTES :] + more_keys, dtype=f"V{KEY_BYTES}")
    in_order = np.argsort(both, kind="stable")  # as S3 lists them (not timed)
    relisted = Listing.packed(
        both[in_order].tobytes(),
        np.concatenate([mtimes[k:], more_mtimes + 60])[in_order],
        np.concatenate([sizes[k:], more_sizes])[in_order],
    )
    (added, dropped), relist_s, _ = measured(lambda: merge(index, relisted, True))
    assert (added, dropped) == (k, k), (added, dropped)

    probe = [ObjectKey.from_bytes(keys[i * KEY_BYTES : (i + 1) * KEY_BYTES]) for i in range(k, k + 1000)]
    writes = [ObjectKey(FINGERPRINT, 0, os.urandom(16)) for _ in range(1000)]
    began = time.perf_counter()
    for key in writes:
        index.set(key, 1 << 21)
    set_us = (time.perf_counter() - began) / len(writes) * 1e6
    began = time.perf_counter()
    assert all(key in index for key in probe)
    contains_us = (time.perf_counter() - began) / len(probe) * 1e6
    began = time.perf_counter()
    victims = index.take_oldest(1000 * (2 << 20), lambda key: False)
    evict_ms = (time.perf_counter() - began) * 1e3
    row = {
        "objects": n,
        "columns_b": index.memory_bytes / len(index),
        "held_b": held / n,
        "peak_b": merge_peak / n,
        "merge_s": merge_s,
        "relist_s": relist_s,
        "set_us": set_us,
        "contains_us": contains_us,
        "evict_ms": evict_ms,
        "evicted": len(victims),
    }
    if n <= baseline_max:
        row.update(baseline(keys, mtimes, sizes))
    return row


def baseline(keys: bytes, mtimes: np.ndarray, sizes: np.ndarray) -> dict[str, Any]:
    """A plain Python index of the same listing: key → (time, size), and the keys oldest first."""
    n = len(mtimes)
    times, lengths = mtimes.tolist(), sizes.tolist()
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]

    def build() -> tuple[dict[ObjectKey, tuple[float, int]], list[ObjectKey]]:
        table = {
            ObjectKey.from_bytes(keys[i * KEY_BYTES : (i + 1) * KEY_BYTES]): (times[i], lengths[i])
            for i in range(n)
        }
        return table, sorted(table, key=lambda key: (table[key][0], key.raw))

    built, took, _ = measured(build)
    held = tracemalloc.get_traced_memory()[0] - before
    del built
    return {"base_b": held / n, "base_s": took}


def on_moto(n: int) -> None:
    """A tier's start-up listing and merge of ``n`` objects on moto, against a raw boto3 listing."""
    import boto3

    from tiercache.config import S3Config
    from tiercache.l3_s3 import S3Tier
    from tiercache.l3_s3.names import ObjectNames
    from tiercache.testing.s3 import s3_endpoint

    with s3_endpoint("moto") as url:
        s3 = boto3.client(
            "s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
        )
        s3.create_bucket(Bucket="bench-index")
        names = ObjectNames("bench")
        keys = [ObjectKey(FINGERPRINT, 0, os.urandom(16)) for _ in range(n)]
        began = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            list(
                pool.map(
                    lambda key: s3.put_object(Bucket="bench-index", Key=names.object(key), Body=b"x"), keys
                )
            )
        print(f"moto: {n:,} objects written in {time.perf_counter() - began:.0f} s")
        for attempt in range(2):
            began = time.perf_counter()
            listed = 0
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket="bench-index", Prefix="bench/"):
                listed += len(page.get("Contents", ()))
            raw_s = time.perf_counter() - began
            os.environ.setdefault("AWS_ACCESS_KEY_ID", "x")
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "x")
            config = S3Config(
                bucket="bench-index", prefix="bench", endpoint_url=url, region="us-east-1", path_style=True
            )
            began = time.perf_counter()
            tier = S3Tier(config)
            assert tier.wait_indexed(600)
            tier_s = time.perf_counter() - began
            objects = tier.usage().objects
            tier.close()
            assert (listed, objects) == (n, n), (listed, objects)
            print(
                f"moto, run {attempt + 1}: raw boto3 listing {raw_s:.2f} s; tier start-up (listing + merge) "
                f"{tier_s:.2f} s; ratio {tier_s / raw_s:.2f}x"
            )


def figure(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(MISSING)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["objects"] for r in rows]
    left.plot(xs, [r["held_b"] for r in rows], "o-", label="tiercache index")
    based = [r for r in rows if "base_b" in r]
    left.plot([r["objects"] for r in based], [r["base_b"] for r in based], "s--", label="plain Python dict")
    left.set(xscale="log", yscale="log", xlabel="objects under the prefix", ylabel="bytes per object")
    left.legend()
    right.plot(xs, [r["merge_s"] for r in rows], "o-", label="start-up merge")
    right.plot(xs, [r["relist_s"] for r in rows], "^-", label="relisting merge")
    right.plot([r["objects"] for r in based], [r["base_s"] for r in based], "s--", label="plain dict build")
    right.set(xscale="log", yscale="log", xlabel="objects under the prefix", ylabel="CPU seconds")
    right.legend()
    fig.suptitle("S3 capacity index: memory and merge time (python benchmarks/s3_index.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"figure: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="10000,100000,1000000,10000000")
    parser.add_argument("--baseline-max", type=int, default=1_000_000)
    parser.add_argument("--moto-max", type=int, default=0, help="objects to write to moto (0: skip)")
    parser.add_argument("--png", type=Path)
    args = parser.parse_args()
    tracemalloc.start()
    rows = []
    print(
        "objects     columns B/obj  held B/obj  merge peak B/obj  merge s  relist s  set µs  contains µs  "
        "evict 1000 ms | plain dict B/obj  build s  memory ÷  time ÷"
    )
    for n in (int(s) for s in args.sizes.split(",")):
        r = one_size(n, args.baseline_max)
        rows.append(r)
        base = (
            f"{r['base_b']:16.0f}  {r['base_s']:7.2f}  {r['held_b'] / r['base_b']:8.3f}  "
            f"{r['merge_s'] / r['base_s']:6.3f}"
            if "base_b" in r
            else "               –        –         –       –"
        )
        print(
            f"{n:>10,}  {r['columns_b']:13.1f}  {r['held_b']:10.1f}  {r['peak_b']:16.0f}  {r['merge_s']:7.2f}  "
            f"{r['relist_s']:8.2f}  {r['set_us']:6.1f}  {r['contains_us']:11.1f}  {r['evict_ms']:13.1f} | {base}",
            flush=True,
        )
    tracemalloc.stop()
    if args.moto_max:
        on_moto(args.moto_max)
    if args.png:
        figure(rows, args.png)


if __name__ == "__main__":
    main()
