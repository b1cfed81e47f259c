"""``tiercache clear`` and ``tiercache warm``: long operations on a live server's tiers, with progress.

Both work in batches over the protocol (``clear_batch``, ``list_keys`` + ``warm``), so a tier of a
million objects is neither one request that outlives every timeout nor a silent wait: on a terminal
a ``rich`` progress bar on stderr advances per batch. Without a terminal on stderr, or with
``--json``, nothing but the result is printed (a summary line, or one JSON document on stdout).

Errors are :class:`~tiercache.errors.ConfigError` (usage: exit 2) or other
:class:`~tiercache.errors.TierCacheError` (exit 1); :func:`tiercache.cli.app.main` prints them in one line.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from tiercache.cli.connection import add_server_options, connect
from tiercache.cli.inspect import parse_fingerprint
from tiercache.cli.output import Progress, format_bytes, print_json
from tiercache.client.client import Client
from tiercache.config.units import parse_size
from tiercache.errors import ConfigError, ProtocolError
from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey

#: Keys per list_keys page while warming (the server's maximum: each page scans the tier once).
_LIST_PAGE = 10_000
_MAX_BATCH = 10_000


@contextmanager
def _server(args: argparse.Namespace, name: str) -> Iterator[Client]:
    client = connect(args, name)
    try:
        yield client
    except ProtocolError as exc:
        if exc.code == "unknown_op":
            raise ProtocolError(
                f"the server at {client.endpoint} is older than this tiercache and cannot {args.command} in "
                "batches; upgrade the server, or use a tiercache CLI of its version",
                exc.code,
            ) from exc
        raise
    finally:
        client.close()


def _batch(args: argparse.Namespace) -> int:
    if not 1 <= args.batch <= _MAX_BATCH:
        raise ConfigError(f"--batch {args.batch} is out of range; use 1 to {_MAX_BATCH}")
    return int(args.batch)


def _tier_names(stats: dict[str, Any]) -> list[str]:
    return list(stats.get("tiers", {}))  # the engine's order: fastest first


# -- clear -----------------------------------------------------------------------------------------
def _clear(args: argparse.Namespace) -> int:
    batch = _batch(args)
    fp = None if args.fingerprint is None else parse_fingerprint(args.fingerprint)
    with _server(args, "tiercache-clear") as client:
        stats = client.stats()
        names = _tier_names(stats)
        if args.tier is not None and args.tier not in names:
            raise ConfigError(f"--tier {args.tier!r}: this server has {', '.join(names)}")
        targets = [args.tier] if args.tier else names  # L1 first: nothing new flows down from it
        held = {t: int(stats["tiers"][t].get("objects", 0)) for t in targets}
        if not args.yes:
            what = "" if fp is None else f" of fingerprint {fp.hex}"
            raise ConfigError(
                f"clear deletes every object{what} from {', '.join(targets)} "
                f"({sum(held.values())} held now); add --yes to confirm"
            )
        started = time.monotonic()
        cleared: dict[str, int] = {}
        with Progress.for_terminal(args.json) as progress:
            for tier in targets:
                # With a fingerprint the matching count is unknown up front: a pulsing bar.
                task = progress.step(f"clear {tier}", held[tier] if fp is None else None)
                n = 0
                while got := client.clear_batch(batch, tier=tier, fingerprint=fp):
                    n += got
                    progress.advance(task, got, f"{n} objects")
                progress.finish(task, f"{n} objects")
                cleared[tier] = n
        seconds = round(time.monotonic() - started, 3)
    total = sum(cleared.values())
    if args.json:
        print_json({"cleared": cleared, "objects": total, "seconds": seconds})
    else:
        per = ", ".join(f"{t} {n}" for t, n in cleared.items())
        print(f"cleared {total} objects ({per}) in {seconds:.1f} s")
    return 0


# -- warm ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class WarmResult:
    """What ``tiercache warm`` did (its ``--json`` document)."""

    tier: str
    budget_bytes: int
    promoted: int = 0
    bytes: int = 0
    present: int = 0
    failed: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def _warm(args: argparse.Namespace) -> int:
    batch = _batch(args)
    fp = None if args.fingerprint is None else parse_fingerprint(args.fingerprint)
    with _server(args, "tiercache-warm") as client:
        stats = client.stats()
        names = _tier_names(stats)
        lower = names[1:]
        if not lower:
            raise ConfigError(f"this server has only {names[0]}: there is no lower tier to warm L1 from")
        tier = args.tier or lower[0]
        if tier not in lower:
            raise ConfigError(
                f"--tier {tier!r}: warm copies from a lower tier into {names[0]}; use one of {', '.join(lower)}"
            )
        l1 = stats["tiers"][names[0]]
        free = max(0, int(l1.get("bytes_budget", 0)) - int(l1.get("bytes_used", 0)))
        if args.budget is not None:
            budget = parse_size(args.budget)
            if budget <= 0:
                raise ConfigError(f"--budget {args.budget!r} must be positive; use e.g. 1g")
        else:
            budget = free
        result = WarmResult(tier=tier, budget_bytes=budget)
        started = time.monotonic()
        if budget == 0:
            result.notes.append(
                f"{names[0]} has no free space; pass --budget to warm anyway (evicts its oldest objects)"
            )
        else:
            _warm_loop(client, tier, fp, batch, budget, result, stats, args.json)
        result.seconds = round(time.monotonic() - started, 3)
    if args.json:
        print_json(asdict(result))
    else:
        print(
            f"warmed {result.promoted} objects ({format_bytes(result.bytes)}) from {tier} into {names[0]}; "
            f"{result.present} already there, {result.failed} failed; budget {format_bytes(budget)}, "
            f"{result.seconds:.1f} s"
        )
        for note in result.notes:
            print(note)
    return 0


def _warm_loop(
    client: Client,
    tier: str,
    fp: Fingerprint | None,
    batch: int,
    budget: int,
    result: WarmResult,
    stats: dict[str, Any],
    as_json: bool,
) -> None:
    """Page through ``tier``'s keys, most recently used first (so a budget smaller than the tier
    gets the hottest objects), and promote them in batches until the budget is spent or the tier is
    exhausted."""
    held = int(stats["tiers"][tier].get("bytes_used", 0))
    with Progress.for_terminal(as_json) as progress:
        task = progress.step(f"warm l1 from {tier}", min(budget, held) if fp is None else budget)
        cursor = b""
        while result.bytes < budget:
            page, cursor = client.list_keys(
                tier=tier, fingerprint=fp, cursor=cursor, limit=_LIST_PAGE, order="use"
            )
            keys = [ObjectKey.from_bytes(k.key) for k in page]
            for i in range(0, len(keys), batch):
                reply = client.warm(keys[i : i + batch], max_bytes=budget - result.bytes)
                result.promoted += reply.promoted
                result.bytes += reply.bytes
                result.present += reply.present
                result.failed += reply.failed
                progress.advance(
                    task, reply.bytes, f"{result.promoted} objects, {format_bytes(result.bytes)}"
                )
                if result.bytes >= budget:
                    break
            if not cursor:
                break
        progress.finish(task, f"{result.promoted} objects, {format_bytes(result.bytes)}")


# -- parsers ---------------------------------------------------------------------------------------
def _server_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    add_server_options(
        common,
        timeout=60.0,
        timeout_help="reply timeout per batch (default 60: a batch on S3 is many requests)",
    )
    common.add_argument(
        "--fingerprint", default=None, metavar="HEX", help="only objects of this fingerprint (32 hex)"
    )
    common.add_argument(
        "--batch", type=int, default=256, metavar="N", help="objects per request (default 256, at most 10000)"
    )
    common.add_argument("--json", action="store_true", help="print one JSON document, no progress bar")
    return common


def add_ops_parsers(sub: Any) -> None:
    """Add ``clear`` and ``warm`` to the top-level subparsers ``sub``."""
    common = _server_options()
    c = sub.add_parser(
        "clear",
        parents=[common],
        allow_abbrev=False,
        help="delete every object (or one fingerprint's) from a live server's tiers, with progress",
        description=(
            "Delete objects from a running server, in batches, with a progress bar on a terminal: from "
            "--tier only (l1, disk, s3), or from every tier (fastest first). Needs --yes. "
            "Reference: docs/operations.md."
        ),
    )
    c.add_argument("--tier", default=None, help="only this tier (default: every tier)")
    c.add_argument("--yes", action="store_true", help="confirm: the objects are deleted for good")
    c.set_defaults(func=_clear)

    w = sub.add_parser(
        "warm",
        parents=[common],
        allow_abbrev=False,
        help="promote objects from a lower tier into L1 up to a byte budget, with progress",
        description=(
            "Copy objects of a lower tier (--tier, default the first: disk) into a running server's L1, most "
            "recently used first, until --budget bytes are promoted (default: L1's free space, so nothing in "
            "L1 is evicted). Reference: docs/operations.md."
        ),
    )
    w.add_argument("--tier", default=None, help="the tier to copy from (default: the first lower tier)")
    w.add_argument(
        "--budget",
        default=None,
        metavar="SIZE",
        help="bytes to promote, e.g. 512m or 4g (default: L1's free space; more evicts older L1 objects)",
    )
    w.set_defaults(func=_warm)


__all__ = ["WarmResult", "add_ops_parsers"]
