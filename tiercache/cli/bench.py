"""``tiercache bench``: each tier's throughput against its raw baseline on this machine.

The measurements are :mod:`tiercache.cli.measure`; this module parses the arguments, shows progress
on stderr (a bar on a terminal, one plain line per case otherwise) and prints the table on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from tiercache.cli import measure
from tiercache.cli.output import Progress, format_size
from tiercache.config.parts import S3Config
from tiercache.config.server import default_data_dir
from tiercache.config.units import parse_size
from tiercache.config.values import parse_tier_list
from tiercache.errors import ConfigError


class BenchProgress:
    """Shows ``tiercache bench`` advancing, one step per tier × chunk size case, on ``stream``.

    On a terminal, a ``rich`` progress bar (elapsed time, the case running now); otherwise (a pipe, a
    log file, CI) one plain line per case, so logs stay readable. Never writes to stdout, which carries
    the result table. Use as a context manager; :meth:`__call__` is the bench's progress callback.
    """

    def __init__(self, total: int, stream: TextIO | None = None, tty: bool | None = None) -> None:
        self.total = total
        stream = sys.stderr if stream is None else stream
        self.tty = stream.isatty() if tty is None else tty
        self.done = 0
        self._progress = Progress(enabled=self.tty, stream=stream)
        self._task: int | None = None
        self._started = 0.0

    def __enter__(self) -> BenchProgress:
        self._progress.__enter__()
        self._task = self._progress.step("bench", self.total)
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)

    def note(self, text: str) -> None:
        """A line of context (which tier, against what), above the bar on a terminal."""
        self._progress.note(text)

    def __call__(self, tier: str, chunk_bytes: int, phase: str) -> None:
        case = f"{tier} {format_size(chunk_bytes)}"
        if phase == "start":
            self._started = time.monotonic()
            if self.tty:
                self._progress.describe(self._task, f"bench {case}")
            else:
                self.note(f"[{self.done + 1}/{self.total}] {case} …")
            return
        self.done += 1
        if self.tty:
            self._progress.advance(self._task, 1, f"{self.done}/{self.total}")
        else:
            self.note(f"[{self.done}/{self.total}] {case} done in {time.monotonic() - self._started:.2f} s")


def _bench(args: argparse.Namespace) -> int:
    tiers = parse_tier_list(args.tiers, "--tiers", stack=False)
    sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else list(measure.DEFAULT_SIZES)
    total = args.total_mb << 20
    if total <= 0 or args.rounds < 1:
        raise ConfigError(
            f"--total-mb {args.total_mb} and --rounds {args.rounds} must both be positive; "
            "use e.g. --total-mb 256 --rounds 3"
        )
    if "s3" in tiers and not args.s3_bucket:
        raise ConfigError("--tiers includes s3: give --s3-bucket (and --s3-endpoint-url if not AWS)")
    rows: list[measure.BenchRow] = []
    with BenchProgress(len(tiers) * len(sizes)) as progress:
        if "l1" in tiers:
            progress.note("measuring L1 (shared arena) against memcpy …")
            rows += measure.bench_l1(sizes, total, args.rounds, progress=progress)
        if "disk" in tiers:
            disk_path = Path(args.disk_path)
            disk_path.mkdir(parents=True, exist_ok=True, mode=0o700)
            progress.note(f"measuring L2 (LMDB under {disk_path}) against raw lmdb …")
            rows += measure.bench_disk(sizes, total, args.rounds, disk_path, progress=progress)
        if "s3" in tiers:
            cfg = S3Config(
                bucket=args.s3_bucket,
                prefix=args.s3_prefix,
                endpoint_url=args.s3_endpoint_url,
                region=args.s3_region,
                path_style=args.s3_path_style,
                create_bucket=args.s3_create_bucket,
            )
            progress.note(f"measuring L3 (s3://{cfg.bucket}/{cfg.prefix}) against raw boto3 …")
            rows += measure.bench_s3(sizes, max(total // 4, 1 << 20), args.rounds, cfg, progress=progress)
    print(measure.render(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_dict() for r in rows], indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def add_bench_parser(sub: Any) -> None:
    """Add ``bench`` to the top-level subparsers ``sub``."""
    b = sub.add_parser(
        "bench",
        help="measure each tier against its raw baseline on this machine",
        description=(
            "Measure put/get throughput of each tier and, in the same run, of the raw operation it is "
            "built on (memcpy for L1, lmdb for L2, boto3 for L3). Prints GB/s and the ratio."
        ),
    )
    b.add_argument("--tiers", default="l1,disk", help="tiers to measure (default: l1,disk)")
    b.add_argument("--sizes", default="", help="chunk sizes, e.g. 256k,1m,4m (default)")
    b.add_argument("--total-mb", type=int, default=256, help="bytes per case in MiB (default 256)")
    b.add_argument("--rounds", type=int, default=3, help="timed rounds per case (median; default 3)")
    b.add_argument(
        "--disk-path",
        default=str(default_data_dir() / "bench"),
        help="where the LMDB benchmark writes (default: the per-user data dir); removed afterwards",
    )
    b.add_argument("--s3-bucket", help="bucket for the s3 tier")
    b.add_argument("--s3-prefix", default="tiercache-bench", help="key prefix (default tiercache-bench)")
    b.add_argument("--s3-endpoint-url", help="S3-compatible endpoint, e.g. http://127.0.0.1:9000")
    b.add_argument("--s3-region", help="S3 region")
    b.add_argument("--s3-path-style", action="store_true", help="path-style addressing")
    b.add_argument("--s3-create-bucket", action="store_true", help="create the bucket if missing")
    b.add_argument("--json", help="also write the rows as JSON to this file")
    b.set_defaults(func=_bench)
