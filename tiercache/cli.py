"""The ``tiercache`` command line. The only place that maps errors to exit codes.

Subcommands: ``server`` (run a server; its flags come from the option table in
:mod:`tiercache.settings`), ``config docs`` (the configuration reference, generated from that table),
``bench`` (tier throughput against raw baselines on this machine) and ``inspect`` (what the cache
holds and why, from a live server or read-only from a disk path / S3 prefix; see
:mod:`tiercache.cli_inspect`), ``clear`` and ``warm`` (delete from / promote into a live server's tiers
in batches, with a progress bar; see :mod:`tiercache.cli_ops`).

Exit codes: 0 success; 2 a usage or configuration error (bad flag, environment variable or config
file; one line ``tiercache: error: ...``); 1 a start-up or run-time failure (unwritable directory,
unreachable bucket or server, ``/dev/shm`` too small); 130 interrupted, or forced exit on a second signal.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

from tiercache import __version__
from tiercache.errors import ConfigError, TierCacheError
from tiercache.settings import (
    CONFIG_ENV,
    ServerConfig,
    add_server_arguments,
    default_data_dir,
    flags_from_namespace,
    render_docs,
)

KNOWN_TIERS = ("l1", "disk", "s3")

__all__ = ["build_parser", "default_data_dir", "main"]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, ``tiercache: error: ...``, exit status 2.

    argparse would print the whole usage block first; for a server with fifty flags that buries the
    one line that matters. ``--help`` still shows everything.
    """

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):
            message += self._suggest(message.split(":", 1)[1].split())
        self.exit(2, f"tiercache: error: {message} (see {self.prog} --help)\n")

    def _suggest(self, words: list[str]) -> str:
        flags = [s for a in self._all_actions() for s in a.option_strings]
        for word in words:
            close = difflib.get_close_matches(word.split("=")[0], flags, n=1, cutoff=0.6)
            if close:
                return f"; did you mean {close[0]}?"
        return ""

    def _all_actions(self) -> list[argparse.Action]:
        actions = list(self._actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    actions.extend(sub._actions)
        return actions


def parse_tiers(text: str) -> list[str]:
    """``"l1,disk"`` → ``["l1", "disk"]``; every name known, no repeats, not empty."""
    tiers = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in tiers if t not in KNOWN_TIERS]
    if not tiers or unknown or len(set(tiers)) != len(tiers):
        raise ConfigError(
            f"--tiers {text!r} is not valid; use a comma-separated subset of {','.join(KNOWN_TIERS)}, "
            "e.g. l1,disk"
        )
    return tiers


def parse_size(text: str) -> int:
    """``"256k"``, ``"4m"``, ``"1048576"`` → bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError as exc:
        raise ConfigError(f"{text!r} is not a size; use e.g. 256k, 1m or 4m") from exc


def _size_text(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


class BenchProgress:
    """Shows ``tiercache bench`` advancing, one step per tier × chunk size case, on ``stream``.

    On a terminal, a ``rich`` progress bar (elapsed time, the case running now); otherwise (a pipe, a
    log file, CI) one plain line per case, so logs stay readable. Never writes to stdout, which carries
    the result table. Use as a context manager; :meth:`__call__` is the bench's progress callback.
    """

    def __init__(self, total: int, stream: TextIO | None = None, tty: bool | None = None) -> None:
        self.total = total
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty() if tty is None else tty
        self.done = 0
        self._started = 0.0
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> BenchProgress:
        if self.tty:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(file=self.stream, force_terminal=True),
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task("bench", total=self.total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def note(self, text: str) -> None:
        """A line of context (which tier, against what), above the bar on a terminal."""
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def __call__(self, tier: str, chunk_bytes: int, phase: str) -> None:
        case = f"{tier} {_size_text(chunk_bytes)}"
        if phase == "start":
            self._started = time.monotonic()
            if self._bar is not None:
                self._bar.update(self._task, description=f"bench {case}")
            else:
                print(f"[{self.done + 1}/{self.total}] {case} …", file=self.stream, flush=True)
            return
        self.done += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1)
        else:
            took = time.monotonic() - self._started
            print(f"[{self.done}/{self.total}] {case} done in {took:.2f} s", file=self.stream, flush=True)


def _bench(args: argparse.Namespace) -> int:
    from tiercache import bench
    from tiercache.config import S3Config

    tiers = parse_tiers(args.tiers)
    sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else list(bench.DEFAULT_SIZES)
    total = args.total_mb << 20
    if total <= 0 or args.rounds < 1:
        raise ConfigError(
            f"--total-mb {args.total_mb} and --rounds {args.rounds} must both be positive; "
            "use e.g. --total-mb 256 --rounds 3"
        )
    if "s3" in tiers and not args.s3_bucket:
        raise ConfigError("--tiers includes s3: give --s3-bucket (and --s3-endpoint-url if not AWS)")
    rows: list[bench.BenchRow] = []
    with BenchProgress(len(tiers) * len(sizes)) as progress:
        if "l1" in tiers:
            progress.note("measuring L1 (shared arena) against memcpy …")
            rows += bench.bench_l1(sizes, total, args.rounds, progress=progress)
        if "disk" in tiers:
            disk_path = Path(args.disk_path)
            disk_path.mkdir(parents=True, exist_ok=True, mode=0o700)
            progress.note(f"measuring L2 (LMDB under {disk_path}) against raw lmdb …")
            rows += bench.bench_disk(sizes, total, args.rounds, disk_path, progress=progress)
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
            rows += bench.bench_s3(sizes, max(total // 4, 1 << 20), args.rounds, cfg, progress=progress)
    print(bench.render(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_dict() for r in rows], indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _server(args: argparse.Namespace) -> int:
    from tiercache.serve import run

    config = ServerConfig.load(flags_from_namespace(args), os.environ, args.config)
    logging.basicConfig(
        level=config.log_level.value.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # The AWS SDK's own DEBUG output prints request headers, the Authorization header with the access
    # key id included: credentials must never reach the log, so --log-level debug stops at tiercache.
    for sdk in ("botocore", "boto3", "s3transfer", "urllib3"):
        logging.getLogger(sdk).setLevel(max(logging.INFO, logging.getLogger().level))
    try:
        run(config)
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("tiercache.server"):
            raise
        print("tiercache: error: this build has no server (tiercache.server is missing)", file=sys.stderr)
        return 1
    return 0


def _config_docs(args: argparse.Namespace) -> int:
    text = render_docs()
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed so docs and tests can inspect the flags)."""
    parser = _Parser(
        prog="tiercache",
        description="Tiered KV-cache storage for LLM serving: L1 host memory, L2 LMDB disk, L3 S3.",
    )
    parser.add_argument("--version", action="version", version=f"tiercache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    srv = sub.add_parser(
        "server",
        help="run a tiercache server (the default: l1 + disk under the per-user data dir)",
        description=(
            "Run a tiercache server on this node. Every setting can also come from a TIERCACHE_* "
            "environment variable or a TOML file (--config); flags win over the environment, which "
            "wins over the file. Sizes take decimals (--l1-size-gb 0.5). First SIGINT/SIGTERM drains "
            "and stops; a second forces exit. Reference: docs/configuration.md."
        ),
        allow_abbrev=False,  # a later flag must not change what an abbreviation in a script means
    )
    srv.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help=f"TOML config file with top-level keys and [server] [l1] [disk] [s3] [engine] tables "
        f"(default: none; env {CONFIG_ENV})",
    )
    add_server_arguments(srv)
    srv.set_defaults(func=_server)

    cfg = sub.add_parser("config", help="configuration helpers", description="Configuration helpers.")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    docs = cfg_sub.add_parser(
        "docs",
        help="print the configuration reference (docs/configuration.md) generated from the options",
        description="Print the configuration reference generated from the option table.",
    )
    docs.add_argument("--output", metavar="FILE", help="write it to FILE instead of stdout")
    docs.set_defaults(func=_config_docs)

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

    from tiercache.cli_inspect import add_inspect_parser

    add_inspect_parser(sub, _Parser)
    from tiercache.cli_ops import add_ops_parsers

    add_ops_parsers(sub)
    return parser


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tiercache`` console script."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed in one line
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"tiercache: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except TierCacheError as exc:
        print(f"tiercache: {type(exc).__name__}: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
