"""Shared fixtures: a controllable clock, payload helpers and an S3 endpoint over real HTTP."""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tiercache.testing.fixtures import FakeClock, make_key, payload_for

__all__ = ["FakeClock", "S3Endpoint", "make_key", "payload_for"]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@dataclass(frozen=True)
class S3Endpoint:
    url: str
    region: str = "us-east-1"

    def reset(self) -> None:
        """Drop every bucket and object (moto's reset API), keeping the server up."""
        req = urllib.request.Request(f"{self.url}/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=10).read()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Endpoint]:
    """moto's S3 server on 127.0.0.1, spoken to over real HTTP by boto3 (never patched)."""
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield S3Endpoint(f"http://{host}:{port}")
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server: S3Endpoint) -> Iterator[S3Endpoint]:
    """The session's S3 endpoint, emptied before each test."""
    s3_server.reset()
    yield s3_server
