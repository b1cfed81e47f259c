"""``tiercache inspect``: what the cache holds and why, from a live server or offline storage.

Subcommands ``summary`` (``--watch``), ``keys``, ``fingerprints`` and ``explain``; each takes the source
options (``--server``/``--auth-secret`` for a live server, or ``--disk-path`` and/or ``--s3-*`` to read
stored data read-only) and ``--json``. The data comes from :mod:`tiercache.cli.sources` and the tables
are drawn with ``rich`` by :mod:`tiercache.cli.inspect_views`; this module parses arguments, checks
them, opens the source and hands what it returns to JSON or to a view. Errors are raised as
:class:`~tiercache.errors.ConfigError` (usage: exit 2) or other :class:`~tiercache.errors.TierCacheError`
(unreachable: exit 1); :func:`tiercache.cli.app.main` prints them in one line. Secrets never reach output.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from tiercache.cli.connection import add_server_options, connect
from tiercache.cli.inspect_views import (
    print_explain,
    print_fingerprints,
    print_keys,
    summary_view,
    tenant_view,
)
from tiercache.cli.output import console as stdout_console
from tiercache.cli.output import print_json
from tiercache.cli.sources import KeyFilter, LiveSource, OfflineSource, explain_report
from tiercache.errors import ConfigError
from tiercache.keys.fingerprint import Fingerprint

_TOKEN_SPLIT = re.compile(r"[\s,]+")


# -- argument parsing ------------------------------------------------------------------------------
def _source_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    live = common.add_argument_group("live server (the default)")
    add_server_options(live, timeout=5.0, timeout_help="reply timeout (default 5)")
    off = common.add_argument_group("offline, read-only (instead of --server)")
    off.add_argument("--disk-path", metavar="DIR", default=None, help="a disk tier's LMDB directory")
    off.add_argument("--s3-bucket", metavar="BUCKET", default=None, help="an S3 tier's bucket")
    off.add_argument("--s3-prefix", metavar="PREFIX", default=None, help="its key prefix (default tiercache)")
    off.add_argument(
        "--s3-endpoint-url", metavar="URL", default=None, help="S3-compatible endpoint (default AWS)"
    )
    off.add_argument("--s3-region", metavar="REGION", default=None, help="S3 region")
    off.add_argument("--s3-path-style", action="store_true", default=None, help="path-style addressing")
    common.add_argument("--json", action="store_true", help="print JSON (stable shape, docs/operations.md)")
    return common


def add_inspect_parser(sub: Any, parser_class: type[argparse.ArgumentParser]) -> None:
    """Add ``inspect`` and its subcommands to the top-level subparsers ``sub``."""
    common = _source_options()
    ins = sub.add_parser(
        "inspect",
        help="show what the cache holds and why (live server, or a disk path / S3 prefix read-only)",
        description=(
            "Inspect a running server (--server, default: its default socket) or stored data "
            "offline and strictly read-only (--disk-path and/or --s3-bucket). Human tables by default, "
            "--json for scripts. Reference: docs/operations.md."
        ),
    )
    ins_sub = ins.add_subparsers(
        dest="inspect_command", required=True, metavar="SUBCOMMAND", parser_class=parser_class
    )
    # In this order: it is the order `tiercache inspect --help` lists them in.
    _add_summary_parser(ins_sub, common)
    _add_keys_parser(ins_sub, common)
    _add_fingerprints_parser(ins_sub, common)
    _add_explain_parser(ins_sub, common)


def _add_summary_parser(ins_sub: Any, common: argparse.ArgumentParser) -> None:
    s = ins_sub.add_parser(
        "summary",
        parents=[common],
        allow_abbrev=False,
        help="per tier: bytes used/budget, objects, hit rate, evictions, verify failures, drops, errors",
        description="Per tier usage and counters (counters only from a live server).",
    )
    s.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C; live server only",
    )
    s.add_argument(
        "--by-tenant",
        action="store_true",
        help="also a table per tenant (by id, see `tiercache tenant-id`): bytes against quota per "
        "tier, evictions, lookups and chunk hit rate; live server only (--json always has them)",
    )
    s.set_defaults(func=_summary)


def _add_keys_parser(ins_sub: Any, common: argparse.ArgumentParser) -> None:
    k = ins_sub.add_parser(
        "keys",
        parents=[common],
        allow_abbrev=False,
        help="list stored keys, paged",
        description="List object keys (<fingerprint>/g<group>/<prefix hash>) in key order, one page at a time.",
    )
    k.add_argument("--tier", default=None, help="only keys on this tier (l1, disk, s3)")
    k.add_argument(
        "--fingerprint", default=None, metavar="HEX", help="only keys of this fingerprint (32 hex)"
    )
    k.add_argument("--group", type=int, default=None, metavar="N", help="only keys of this object group")
    k.add_argument(
        "--limit", type=int, default=50, metavar="N", help="keys per page (default 50, at most 10000)"
    )
    k.add_argument(
        "--cursor", default="", metavar="CURSOR", help="continue after this cursor (printed with each page)"
    )
    k.set_defaults(func=_keys)


def _add_fingerprints_parser(ins_sub: Any, common: argparse.ArgumentParser) -> None:
    f = ins_sub.add_parser(
        "fingerprints",
        parents=[common],
        allow_abbrev=False,
        help="the layout manifest of every fingerprint seen, side by side",
        description="Each engine layout (fingerprint) seen, with its manifest and object counts.",
    )
    f.set_defaults(func=_fingerprints)


def _add_explain_parser(ins_sub: Any, common: argparse.ArgumentParser) -> None:
    e = ins_sub.add_parser(
        "explain",
        parents=[common],
        allow_abbrev=False,
        help="for a prompt's token ids: where each chunk lives, or why not",
        description=(
            "Hash a prompt's token ids (whitespace/comma separated integers or a JSON list, from FILE or "
            "stdin) into chunks and say, per chunk and object group, which tier holds it or why not: "
            "never stored, evicted (tier, reason; live only), or stored under another fingerprint."
        ),
    )
    e.add_argument("file", nargs="?", default="-", metavar="FILE", help="token ids file (default: stdin)")
    e.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        metavar="TOKENS",
        help="tokens per chunk (default: the live server's; required offline)",
    )
    e.add_argument("--cache-salt", default="", help="the request's cache salt")
    e.add_argument("--lora", default="", metavar="NAME", help="the request's LoRA adapter name")
    e.add_argument(
        "--fingerprint",
        action="append",
        default=[],
        metavar="HEX",
        help="explain against this fingerprint (repeatable; default: every one known)",
    )
    e.add_argument(
        "--group",
        action="append",
        type=int,
        default=[],
        metavar="N",
        help="object group(s) (repeatable; default: the groups seen for each fingerprint)",
    )
    e.set_defaults(func=_explain)


# -- sources ---------------------------------------------------------------------------------------
def _open_source(args: argparse.Namespace) -> LiveSource | OfflineSource:
    s3_flags = [n for n in ("s3_prefix", "s3_endpoint_url", "s3_region", "s3_path_style") if getattr(args, n)]
    offline = args.disk_path is not None or args.s3_bucket is not None
    if s3_flags and args.s3_bucket is None:
        raise ConfigError(
            f"--{s3_flags[0].replace('_', '-')} needs --s3-bucket; add --s3-bucket BUCKET to inspect S3, or drop "
            f"--{s3_flags[0].replace('_', '-')}"
        )
    if offline and (args.server is not None or args.auth_secret is not None):
        raise ConfigError(
            "--server/--auth-secret and --disk-path/--s3-bucket exclude each other: inspect a live "
            "server or stored data, not both"
        )
    if offline:
        return _open_offline(args)
    return _open_live(args)


def _open_live(args: argparse.Namespace) -> LiveSource:
    return LiveSource(connect(args, "tiercache-inspect"))


def _open_offline(args: argparse.Namespace) -> OfflineSource:
    readers: list[Any] = []
    where: list[str] = []
    try:
        if args.disk_path is not None:
            from tiercache.l2_disk.reader import DiskReader

            readers.append(DiskReader(Path(args.disk_path).expanduser()))
            where.append(f"disk {args.disk_path}")
        if args.s3_bucket is not None:
            from tiercache.config.parts import S3Config
            from tiercache.l3_s3.client import printable_endpoint
            from tiercache.l3_s3.reader import S3Reader

            cfg = S3Config(
                bucket=args.s3_bucket,
                prefix="tiercache" if args.s3_prefix is None else args.s3_prefix,
                endpoint_url=args.s3_endpoint_url,
                region=args.s3_region,
                path_style=bool(args.s3_path_style),
                max_attempts=2,
            )
            readers.append(S3Reader(cfg))
            where.append(f"s3://{cfg.bucket}/{cfg.prefix} at {printable_endpoint(cfg.endpoint_url)}")
    except BaseException:
        for r in readers:
            r.close()
        raise
    return OfflineSource(readers, ", ".join(where))


def _close(source: LiveSource | OfflineSource) -> None:
    source.close()
    if isinstance(source, LiveSource):
        source.client.close()


def _run(args: argparse.Namespace, body: Any) -> int:
    source = _open_source(args)
    try:
        return int(body(source))
    finally:
        _close(source)


# -- summary ---------------------------------------------------------------------------------------
def _summary(args: argparse.Namespace) -> int:
    by_tenant = bool(getattr(args, "by_tenant", False))

    def view(data: dict[str, Any]) -> Any:
        summary = summary_view(data)
        if not by_tenant:
            return summary
        from rich.console import Group

        return Group(summary, tenant_view(data.get("tenants", {})))

    def body(source: LiveSource | OfflineSource) -> int:
        if by_tenant and not source.live:
            raise ConfigError("--by-tenant needs a live server (tenants are counted in its memory)")
        if args.watch is None:
            data = source.summary()
            if args.json:
                print_json(data)
            else:
                stdout_console().print(view(data))
            return 0
        if not source.live:
            raise ConfigError("--watch needs a live server; drop --disk-path/--s3-bucket")
        if args.watch <= 0:
            raise ConfigError(f"--watch {args.watch:g} must be a positive number of seconds")
        return _watch(source, args.watch, args.json, view)

    return _run(args, body)


def _watch(source: LiveSource | OfflineSource, interval: float, as_json: bool, view: Any = None) -> int:
    """Refresh until Ctrl-C (exit 0). ``--json`` prints one JSON object per line per refresh."""
    try:
        if as_json:
            while True:
                sys.stdout.write(json.dumps(source.summary()) + "\n")
                sys.stdout.flush()
                time.sleep(interval)
        from rich.live import Live

        view = view or summary_view
        with Live(view(source.summary()), console=stdout_console(), auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                live.update(view(source.summary()), refresh=True)
    except KeyboardInterrupt:
        return 0


# -- keys ------------------------------------------------------------------------------------------
def parse_fingerprint(text: str, flag: str = "--fingerprint") -> Fingerprint:
    """A fingerprint from its 32 hex digits, or a one-line :class:`ConfigError` naming ``flag``."""
    try:
        return Fingerprint.from_hex(text.strip().lower())
    except ValueError as exc:
        raise ConfigError(
            f"{flag} {text!r} is not a fingerprint; use its 32 hex digits (see `tiercache inspect fingerprints`)"
        ) from exc


def _keys(args: argparse.Namespace) -> int:
    if not 1 <= args.limit <= 10_000:
        raise ConfigError(f"--limit {args.limit} is out of range; use 1 to 10000")
    if args.group is not None and not 0 <= args.group <= 0xFFFF:
        raise ConfigError(f"--group {args.group} is out of range; use 0 to 65535")
    try:
        cursor = bytes.fromhex(args.cursor)
    except ValueError as exc:
        raise ConfigError(
            f"--cursor {args.cursor!r} is not a cursor; pass the value a previous page printed"
        ) from exc
    flt = KeyFilter(
        args.tier, None if args.fingerprint is None else parse_fingerprint(args.fingerprint), args.group
    )

    def body(source: LiveSource | OfflineSource) -> int:
        page, nxt = source.keys(flt, args.limit, cursor)
        if args.json:
            print_json({"keys": page, "next_cursor": nxt.hex() or None})
            return 0
        print_keys(page, nxt, source.where)
        return 0

    return _run(args, body)


# -- fingerprints ----------------------------------------------------------------------------------
def _fingerprints(args: argparse.Namespace) -> int:
    def body(source: LiveSource | OfflineSource) -> int:
        rows = source.fingerprints()
        if args.json:
            print_json({"fingerprints": rows})
            return 0
        print_fingerprints(rows, source.where)
        return 0

    return _run(args, body)


# -- explain ---------------------------------------------------------------------------------------
def parse_tokens(text: str, where: str) -> list[int]:
    """Token ids from whitespace/comma separated integers or a JSON list; ``ConfigError`` otherwise."""
    text = text.strip()
    if not text:
        raise ConfigError(f"no token ids in {where}; give whitespace/comma separated integers or a JSON list")
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{where} is not a JSON list of token ids: {exc}") from exc
        if not isinstance(items, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in items
        ):
            raise ConfigError(f"{where}: a JSON list of integer token ids is expected")
        tokens = items
    else:
        tokens = []
        for word in _TOKEN_SPLIT.split(text):
            if not word:
                continue
            try:
                tokens.append(int(word))
            except ValueError:
                raise ConfigError(f"{where}: {word[:20]!r} is not an integer token id") from None
    bad = next((t for t in tokens if not 0 <= t <= 0xFFFFFFFF), None)
    if bad is not None:
        raise ConfigError(f"{where}: token id {bad} is outside 0..4294967295")
    return tokens


def _read_tokens(path: str) -> list[int]:
    if path == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise ConfigError("explain needs token ids: give a FILE or pipe them on stdin")
        return parse_tokens(sys.stdin.read(), "stdin")
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"cannot read token ids from {path}: {exc.__class__.__name__}; check the FILE argument"
        ) from exc
    return parse_tokens(text, path)


def _explain(args: argparse.Namespace) -> int:
    fps = [parse_fingerprint(f) for f in args.fingerprint]
    for g in args.group:
        if not 0 <= g <= 0xFFFF:
            raise ConfigError(f"--group {g} is out of range; use 0 to 65535")
    if args.chunk_size is not None and args.chunk_size < 1:
        raise ConfigError(
            f"--chunk-size {args.chunk_size} must be a positive number of tokens; use the server's --chunk-size "
            "(default 256)"
        )
    offline = args.disk_path is not None or args.s3_bucket is not None
    if offline and args.chunk_size is None:
        raise ConfigError("--chunk-size is required offline (the server's --chunk-size, default 256)")
    tokens = _read_tokens(args.file)

    def body(source: LiveSource | OfflineSource) -> int:
        from tiercache.keys.hashing import ExtraKeys, chunk_hashes

        chunk = args.chunk_size or (source.chunk_size() if isinstance(source, LiveSource) else 0)
        hashes = chunk_hashes(tokens, chunk, ExtraKeys(cache_salt=args.cache_salt, lora_name=args.lora))
        known = source.known_groups()
        groups: list[tuple[Fingerprint, int]] = []
        for fp in fps or sorted(known):
            seen = sorted(known.get(fp, {}))
            for g in args.group or seen or [0]:
                groups.append((fp, g))
        if not groups:
            raise ConfigError(f"{source.where} knows no fingerprint yet; pass --fingerprint HEX")
        report = explain_report(
            chunk, len(tokens), hashes, groups, source.explain(hashes, groups) if hashes else []
        )
        if args.json:
            print_json(report)
            return 0
        print_explain(report, source.where)
        return 0

    return _run(args, body)


__all__ = ["add_inspect_parser", "parse_fingerprint", "parse_tokens"]
