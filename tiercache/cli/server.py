"""``tiercache server`` and ``tiercache config docs``: their flags come from the option table.

:func:`add_server_arguments` adds one flag per option (:mod:`tiercache.config.table`), grouped by
part; only flags actually given reach :meth:`ServerConfig.load
<tiercache.config.server.ServerConfig.load>`, so they win over the environment and the file, and a bad
value gets the same one-line error wherever it came from.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from tiercache.config.docs import render_docs
from tiercache.config.options import CONFIG_ENV
from tiercache.config.server import ServerConfig
from tiercache.config.table import SECTION_TITLES, options


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per option to ``parser``, grouped by part.

    Flags default to ``argparse.SUPPRESS`` so only flags actually given reach the namespace (and win
    over environment and file); values are parsed by :meth:`ServerConfig.load`.
    """
    groups: dict[str, Any] = {}
    for opt in options():
        group = groups.get(opt.section)
        if group is None:
            group = groups[opt.section] = parser.add_argument_group(SECTION_TITLES[opt.section])
        default = "none" if opt.secret else opt.default_text
        helptext = f"{opt.help} (default: {default}; env {opt.env})".replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": opt.dest, "default": argparse.SUPPRESS, "help": helptext}
        if opt.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            choices = opt.choices
            kwargs["metavar"] = "{" + ",".join(choices) + "}" if choices else opt.metavar or opt.field.upper()
        group.add_argument(opt.flag, **kwargs)


def flags_from_namespace(namespace: argparse.Namespace) -> dict[str, Any]:
    """The flags actually given, keyed by option key, for :meth:`ServerConfig.load`."""
    given = vars(namespace)
    return {opt.key: given[opt.dest] for opt in options() if opt.dest in given}


def _server(args: argparse.Namespace) -> int:
    from tiercache.server.run import (
        run,  # the server, the engine and the tiers: only when serving
    )

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
    run(config)
    return 0


def _config_docs(args: argparse.Namespace) -> int:
    text = render_docs()
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def add_server_parsers(sub: Any) -> None:
    """Add ``server`` and ``config docs`` to the top-level subparsers ``sub``."""
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
