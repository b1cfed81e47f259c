"""``tiercache tenant-id``: the id under which a cache salt's tenant appears in ``inspect``, metrics
and ``--l1-tenant-quotas``, computed locally (the salt goes nowhere)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tiercache.errors import ConfigError
from tiercache.keys.tenant import tenant_id, tenant_label


def _tenant_id(args: argparse.Namespace) -> int:
    salts = [line.rstrip("\r\n") for line in sys.stdin] if args.salt == ["-"] else args.salt
    if not salts:
        raise ConfigError("no salt given; pass SALT, or - to read one salt per line from stdin")
    for salt in salts:
        print(tenant_label(tenant_id(salt)))
    return 0


def add_tenant_parser(sub: Any) -> None:
    """Add ``tenant-id`` to the top-level subparsers ``sub``."""
    t = sub.add_parser(
        "tenant-id",
        allow_abbrev=False,
        help="print the tenant id of a cache salt (what inspect, metrics and quotas name it by)",
        description=(
            "Print the 16-hex-digit tenant id of each cache salt: the requests' cache_salt, as vLLM gets "
            "it. Servers never see salts, only these ids; use them in --l1-tenant-quotas and to find a "
            "tenant in `tiercache inspect summary --by-tenant` and in metrics. An empty salt is the "
            "default tenant. Reference: docs/fleet.md."
        ),
    )
    t.add_argument(
        "salt",
        nargs="+",
        metavar="SALT",
        help="a cache salt; - reads one per line from stdin (keeps salts out of shell history and ps)",
    )
    t.set_defaults(func=_tenant_id)


__all__ = ["add_tenant_parser"]
