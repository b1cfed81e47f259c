"""Benchmark every tier against its raw baseline in one run (issue: storage core).

Starts moto's S3 server on 127.0.0.1 for the L3 rows (the same endpoint serves the raw boto3
baseline), then prints the table that docs/benchmarks.md reproduces. Usage::

    python benchmarks/tiers.py [--total-mb 256] [--rounds 5] [--json out.json] [--no-s3]
                               [--sizes 256K,2M] [--tiers l1,disk,s3]
    python benchmarks/tiers.py --profile 2000 --sizes 256K    # where a disk put's time goes

``--profile N`` runs no table: it puts N unsalted objects of the first size into a fresh disk tier
(each key twice, the second an overwrite as in the timed rounds) under cProfile and prints the LMDB
calls per overwrite and the functions that take the most time.

Against a real S3 endpoint use ``tiercache bench --tiers s3 --s3-bucket ... --s3-endpoint-url ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

from tiercache.cli import measure as bench
from tiercache.config import S3Config
from tiercache.testing.s3 import STORES, s3_endpoint

#: What each tier's baseline is, printed under the table so a reader knows what the ratio compares.
BASELINES = {
    "l1": (
        "l1: reserve/copy/commit and pin/copy/release of the same bytes vs memcpy into/out "
        "of the very same arena pages"
    ),
    "disk": (
        "disk: DiskTier.put / read_into vs raw lmdb put / get(buffers=True) + copy of the same "
        "payload bytes under the same keys (both overwrite them each round), same env flags "
        "(sync=False, metasync=False, writemap=False, readahead=True, meminit=False), same "
        "background env.sync() interval, one value per txn. The tier also checksums (xxh3-64) "
        "every byte both ways and keeps its index, LRU and usage records in the same txn; raw "
        "lmdb does neither"
    ),
    "s3": (
        "s3: S3Tier.put / get vs raw boto3 put_object / get_object on the same endpoint, "
        "same client settings and threads"
    ),
}


def parse_size(text: str) -> int:
    """``256K``, ``2M``, ``1048576`` -> bytes."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": bench.KiB, "M": bench.MiB}.get(text[-1:], 1)
    return int(text[:-1] if scale != 1 else text) * scale


def profile_disk_puts(count: int, size: int) -> None:
    """Print where ``count`` overwriting ``DiskTier.put`` calls of ``size`` bytes spend their time."""
    import cProfile
    import pstats

    import numpy as np

    from tiercache.config import DiskConfig
    from tiercache.keys import Fingerprint, ObjectKey
    from tiercache.l2_disk import DiskTier

    fp = Fingerprint(b"bench-profile-fp")
    keys = [ObjectKey(fp, 0, i.to_bytes(16, "big")) for i in range(count)]
    src = memoryview(np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8).tobytes())
    with tempfile.TemporaryDirectory(prefix="tiercache-profile-") as root:
        tier = DiskTier(DiskConfig(path=Path(root) / "disk", budget_bytes=4 * count * size))
        try:
            for key in keys:  # first inserts, not profiled: the timed rounds overwrite
                tier.put(key, src)
            prof = cProfile.Profile()
            prof.enable()
            for key in keys:
                tier.put(key, src)
            prof.disable()
        finally:
            tier.close()
    stats = pstats.Stats(prof)
    total_s = sum(row[2] for row in stats.stats.values())
    print(
        f"# {count} overwriting DiskTier.put of {size} bytes: {total_s / count * 1e6:.1f} µs a put under cProfile"
    )
    calls: dict[str, int] = {}
    for (_file, _line, name), row in stats.stats.items():
        if "lmdb" in name or (
            name.startswith("<method '")
            and any(m in name for m in ("'get'", "'put'", "'commit'", "'delete'", "'begin'"))
        ):
            calls[name] = calls.get(name, 0) + int(row[1])
    print("# LMDB and mapping calls per put (primitive calls / puts):")
    for name, n in sorted(calls.items(), key=lambda kv: -kv[1]):
        print(f"#   {n / count:5.2f}  {name}")
    stats.sort_stats("tottime").print_stats(12)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mb", type=int, default=256, help="bytes per case for L1/L2 (MiB)")
    parser.add_argument("--s3-total-mb", type=int, default=48, help="bytes per case for L3 (MiB)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per case (median)")
    parser.add_argument("--json", help="write the rows as JSON here")
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 rows")
    parser.add_argument(
        "--sizes",
        type=lambda v: [parse_size(x) for x in v.split(",")],
        default=list(bench.DEFAULT_SIZES),
        help="chunk sizes, comma-separated (e.g. 256K,2M); default 256K,1M,4M",
    )
    parser.add_argument(
        "--tiers", default="l1,disk,s3", help="which tiers to run, comma-separated (l1,disk,s3)"
    )
    parser.add_argument(
        "--s3-stores",
        default="moto",
        help="S3 endpoints for the L3 rows, comma-separated: moto (its server mode) and/or rgw (a "
        "throwaway Ceph RADOS Gateway from tiercache.testing.rgw; needs the Ceph packages)",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="instead of the table: profile N overwriting disk puts of the first --sizes",
    )
    args = parser.parse_args()
    if args.profile:
        profile_disk_puts(args.profile, args.sizes[0])
        return 0

    sizes: list[int] = args.sizes
    tiers = {t.strip() for t in args.tiers.split(",")}
    if args.no_s3:
        tiers.discard("s3")
    total = args.total_mb << 20
    print(f"# {platform.node()} {platform.machine()} cpus={os.cpu_count()} python={sys.version.split()[0]}")
    rows: list[bench.BenchRow] = []
    if "l1" in tiers:
        rows += bench.bench_l1(sizes, total, args.rounds)
    if "disk" in tiers:
        rows += bench.bench_disk(sizes, total, args.rounds)
    if "s3" in tiers:
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        stores = [s.strip() for s in args.s3_stores.split(",")]
        if unknown := [s for s in stores if s not in STORES]:
            raise SystemExit(f"unknown --s3-stores entries {unknown}: use moto and/or rgw")
        for store in stores:
            print(f"# s3 store: {store}")
            with s3_endpoint(store) as url:
                cfg = S3Config(
                    bucket="tiercache-bench",
                    endpoint_url=url,
                    region="us-east-1",
                    path_style=True,
                    create_bucket=True,
                    max_concurrency=4,
                )
                store_rows = bench.bench_s3(sizes, args.s3_total_mb << 20, args.rounds, cfg)
            # One table per store: the rows themselves do not name the endpoint.
            print(f"# L3 on {store}")
            print(bench.render(store_rows))
            rows += store_rows
    print(bench.render(rows))
    for tier in ("l1", "disk", "s3"):
        if tier in tiers:
            print(f"# {BASELINES[tier]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.to_dict() for r in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
