"""Fixtures: real server processes on ipc sockets in a temp dir, and engine layouts to register."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.keys import GroupKind, LayoutManifest

CHUNK = 256


def manifest(**changes: object) -> LayoutManifest:
    """A full-attention layout of a tiny model with the server's chunk size."""
    base = LayoutManifest(
        model_id="tiny-llama",
        model_revision="r1",
        kv_dtype="bfloat16",
        attention_backend="TORCH_SDPA",
        kv_layout="NHD",
        kernel_block_size=16,
        manager_block_size=16,
        page_bytes=4096,
        page_bytes_unpadded=4096,
        group_kind=GroupKind.FULL_ATTENTION,
        chunk_size=CHUNK,
        num_layers=2,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


StartServer = Callable[..., ServerProcess]


@dataclasses.dataclass(frozen=True)
class CurveKeys:
    """A CURVE server key pair with one admitted client and one stranger (``zmq.auth`` files)."""

    server_public: bytes  # z85, what clients are given
    server_secret_file: Path
    client_secret_file: Path
    stranger_secret_file: Path


def curve_keys(directory: Path) -> CurveKeys:
    """Certificates under ``directory``: the client's public key is in ``authorized_clients/``."""
    import os

    import zmq.auth

    allowed = directory / "authorized_clients"
    allowed.mkdir(parents=True)
    server_public, server_secret = zmq.auth.create_certificates(directory, "server")
    client_public, client_secret = zmq.auth.create_certificates(directory, "client")
    _, stranger_secret = zmq.auth.create_certificates(directory, "stranger")
    os.replace(client_public, allowed / "client.key")
    server_key, _ = zmq.auth.load_certificate(server_public)
    return CurveKeys(server_key, Path(server_secret), Path(client_secret), Path(stranger_secret))


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[StartServer]:
    """Start servers (own processes) on ipc sockets under ``tmp_path``; all stopped at the end."""
    started: list[ServerProcess] = []
    count = iter(range(1000))

    def start(
        wait: bool = True, listen: str | None = None, client_kw: dict[str, object] | None = None, **kw: object
    ) -> ServerProcess:
        options = dict(kw.pop("options", {}) or {})  # type: ignore[call-overload]
        options.setdefault("chunk_size", CHUNK)
        spec = ServerSpec(
            listen=listen or f"ipc://{tmp_path}/sock-{next(count)}/server.sock", options=options, **kw
        )  # type: ignore[arg-type]
        proc = ServerProcess(spec)
        started.append(proc)
        if wait:
            proc.wait_ready(**(client_kw or {}))
        return proc

    yield start
    for proc in started:
        proc.stop()
