"""Benchmark every tier against its raw baseline in one run (issue: storage core).

Starts moto's S3 server on 127.0.0.1 for the L3 rows (the same endpoint serves the raw boto3
baseline), then prints the table that docs/benchmarks.md reproduces. Usage::

    python benchmarks/tiers.py [--total-mb 256] [--rounds 5] [--json out.json] [--no-s3]

Against a real S3 endpoint use ``tiercache bench --tiers s3 --s3-bucket ... --s3-endpoint-url ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

from tiercache import bench
from tiercache.config import S3Config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mb", type=int, default=256, help="bytes per case for L1/L2 (MiB)")
    parser.add_argument("--s3-total-mb", type=int, default=48, help="bytes per case for L3 (MiB)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per case (median)")
    parser.add_argument("--json", help="write the rows as JSON here")
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 rows")
    args = parser.parse_args()

    sizes = list(bench.DEFAULT_SIZES)
    total = args.total_mb << 20
    print(f"# {platform.node()} {platform.machine()} cpus={os.cpu_count()} python={sys.version.split()[0]}")
    rows = bench.bench_l1(sizes, total, args.rounds)
    rows += bench.bench_disk(sizes, total, args.rounds)
    if not args.no_s3:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            cfg = S3Config(
                bucket="tiercache-bench",
                endpoint_url=f"http://{host}:{port}",
                region="us-east-1",
                path_style=True,
                create_bucket=True,
                max_concurrency=4,
            )
            rows += bench.bench_s3(sizes, args.s3_total_mb << 20, args.rounds, cfg)
        finally:
            server.stop()
    print(bench.render(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.to_dict() for r in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
