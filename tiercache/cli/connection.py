"""How the CLI reaches a live server: the ``--server``/``--auth-secret``/``--timeout`` options every
subcommand that talks to one shares, and the one place that turns them into a client."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from tiercache.client.client import Client
from tiercache.config.parts import default_endpoint
from tiercache.errors import ConfigError, ServerUnavailableError

LISTEN_ENV = "TIERCACHE_LISTEN"
SECRET_ENV = "TIERCACHE_AUTH_SECRET"


def add_server_options(parser: Any, *, timeout: float, timeout_help: str) -> None:
    """Add ``--server``, ``--auth-secret`` and ``--timeout`` (default ``timeout``) to ``parser``
    (a parser or an argument group)."""
    parser.add_argument(
        "--server",
        metavar="ENDPOINT",
        default=None,
        help=f"endpoint of the server: unix:///path/to/socket, ipc:///path/to/socket or tcp://HOST:PORT "
        f"(default: env {LISTEN_ENV}, "
        "else the server's default socket)",
    )
    parser.add_argument(
        "--auth-secret",
        metavar="SECRET",
        default=None,
        help=f"shared secret of a tcp:// server (prefer env {SECRET_ENV}; never printed)",
    )
    parser.add_argument("--timeout", type=float, default=timeout, metavar="SECONDS", help=timeout_help)


def connect(args: argparse.Namespace, client_name: str) -> Client:
    """A :class:`~tiercache.client.client.Client` for the parsed server options (defaults from the
    environment), or a one-line :class:`ConfigError` / :class:`ServerUnavailableError`."""
    endpoint = args.server or os.environ.get(LISTEN_ENV) or default_endpoint()
    timeout = args.timeout
    if not endpoint.startswith(("ipc://", "unix://", "tcp://")):
        raise ConfigError(
            f"--server {endpoint!r} is not an endpoint; use ipc:///path/to/socket, unix:///path/to/socket "
            "or tcp://HOST:PORT"
        )
    if timeout <= 0:
        raise ConfigError(f"--timeout {timeout:g} must be positive; use e.g. --timeout 5")
    hint = "check that `tiercache server` runs and that --server matches its --listen"
    local = endpoint.removeprefix("ipc://").removeprefix("unix://")
    if local != endpoint and not Path(local).exists():
        raise ServerUnavailableError(f"no tiercache server at {endpoint}: the socket does not exist; {hint}")
    secret = args.auth_secret or os.environ.get(SECRET_ENV) or None
    try:
        return Client(endpoint, timeout=timeout, auth_secret=secret, client_name=client_name, heartbeat=False)
    except ServerUnavailableError as exc:
        extra = (
            " (and --auth-secret / TIERCACHE_AUTH_SECRET for tcp://)" if endpoint.startswith("tcp://") else ""
        )
        raise ServerUnavailableError(
            f"no tiercache server answered at {endpoint} within {timeout:g} s; {hint}{extra}"
        ) from exc
