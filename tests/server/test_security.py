"""Specification: owner-only ipc by default; TCP only with authentication."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from tests.server.conftest import StartServer, curve_keys
from tiercache.client.client import Client
from tiercache.errors import AuthenticationError, ServerUnavailableError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ipc_socket_is_owner_only(start_server: StartServer) -> None:
    server = start_server()
    path = Path(server.endpoint[len("ipc://") :])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700


def test_tcp_with_a_shared_secret_refuses_clients_without_it(start_server: StartServer) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = start_server(
        listen=endpoint, options={"auth_secret": "s3cret"}, client_kw={"auth_secret": "s3cret"}
    )
    with pytest.raises(AuthenticationError):
        Client(endpoint, timeout=5, heartbeat=False)
    with pytest.raises(AuthenticationError):
        Client(endpoint, timeout=5, heartbeat=False, auth_secret="wrong")
    with Client(endpoint, timeout=5, auth_secret="s3cret") as client:
        client.ping()
        assert "s3cret" not in repr(client.stats())
    assert server.process.is_alive()


def test_tcp_with_curve_admits_only_known_client_keys(start_server: StartServer, tmp_path: Path) -> None:
    keys = curve_keys(tmp_path / "keys")
    server_key, client_secret = keys.server_public, keys.client_secret_file
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    start_server(
        listen=endpoint,
        options={"curve_secret_key_file": keys.server_secret_file},
        client_kw={"curve_server_key": server_key, "curve_client_key_file": client_secret},
    )
    with Client(
        endpoint, timeout=5, curve_server_key=server_key, curve_client_key_file=client_secret
    ) as client:
        client.ping()
    with pytest.raises(ServerUnavailableError):
        Client(
            endpoint,
            timeout=1,
            heartbeat=False,
            curve_server_key=server_key,
            curve_client_key_file=keys.stranger_secret_file,
        )
    with pytest.raises(ServerUnavailableError):
        Client(endpoint, timeout=1, heartbeat=False)  # plain TCP: the CURVE handshake never completes
