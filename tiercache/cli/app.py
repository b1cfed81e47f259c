"""The ``tiercache`` command line. The only place that maps errors to exit codes.

Subcommands: ``server`` (run a server; its flags come from the option table, see
:mod:`tiercache.cli.server`), ``config docs`` (the configuration reference, generated from that table),
``bench`` (tier throughput against raw baselines on this machine, :mod:`tiercache.cli.bench`),
``inspect`` (what the cache holds and why, from a live server or read-only from a disk path / S3
prefix; :mod:`tiercache.cli.inspect`), ``clear`` and ``warm`` (delete from / promote into a live
server's tiers in batches, with a progress bar; :mod:`tiercache.cli.ops`), ``tenant-id`` (the id a
cache salt's tenant goes by; :mod:`tiercache.cli.tenants`).

Exit codes: 0 success; 2 a usage or configuration error (bad flag, environment variable or config
file; one line ``tiercache: error: ...``); 1 a start-up or run-time failure (unwritable directory,
unreachable bucket or server, ``/dev/shm`` too small); 130 interrupted, or forced exit on a second signal.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from typing import NoReturn

from tiercache import __version__
from tiercache.cli.bench import add_bench_parser
from tiercache.cli.inspect import add_inspect_parser
from tiercache.cli.ops import add_ops_parsers
from tiercache.cli.server import add_server_parsers
from tiercache.cli.tenants import add_tenant_parser
from tiercache.errors import ConfigError, TierCacheError

__all__ = ["build_parser", "main"]


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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed so docs and tests can inspect the flags)."""
    parser = _Parser(
        prog="tiercache",
        description="Tiered KV-cache storage for LLM serving: L1 host memory, L2 LMDB disk, L3 S3.",
    )
    parser.add_argument("--version", action="version", version=f"tiercache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_server_parsers(sub)
    add_bench_parser(sub)
    add_inspect_parser(sub, _Parser)
    add_ops_parsers(sub)
    add_tenant_parser(sub)
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
