"""Helpers for the S3 tier tests: a tier factory, a raw client, a request counter and a TCP proxy."""

from __future__ import annotations

import socket
import threading
from collections import Counter
from typing import Any

import boto3
from botocore.config import Config as BotoConfig

from tests.conftest import FakeClock, S3Endpoint
from tiercache.config import S3Config
from tiercache.l3_s3 import S3Tier

BUCKET = "tiercache-test"


def s3_config(endpoint_url: str, **overrides: Any) -> S3Config:
    """Settings for a test tier: path-style, bucket created on demand, short timeouts, no retries."""
    settings: dict[str, Any] = dict(
        bucket=BUCKET,
        prefix="tc",
        endpoint_url=endpoint_url,
        region="us-east-1",
        path_style=True,
        create_bucket=True,
        connect_timeout_s=1.0,
        read_timeout_s=5.0,
        max_attempts=1,
        breaker_failures=3,
        breaker_cooldown_s=30.0,
    )
    settings.update(overrides)
    return S3Config(**settings)


def make_s3_tier(endpoint: S3Endpoint | str, clock: FakeClock, **overrides: Any) -> S3Tier:
    url = endpoint if isinstance(endpoint, str) else endpoint.url
    tier = S3Tier(s3_config(url, **overrides), clock=clock)
    tier.wait_indexed(10)
    return tier


def raw_client(endpoint: S3Endpoint) -> Any:
    """A plain boto3 client on the same endpoint: how the tests play another writer or bit rot."""
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint.url,
        region_name=endpoint.region,
        config=BotoConfig(s3={"addressing_style": "path"}),
    )


class RequestCounter:
    """Counts HTTP requests clients send, by operation, via botocore's event system (an S3 tier's
    two: ``tier.client, tier.head_client``)."""

    def __init__(self, *clients: Any) -> None:
        self.by_operation: Counter[str] = Counter()
        for client in clients:
            client.meta.events.register("before-call.s3", self._on_call)

    def _on_call(self, model: Any, **_: Any) -> None:
        self.by_operation[model.name] += 1

    @property
    def total(self) -> int:
        return sum(self.by_operation.values())

    def reset(self) -> None:
        self.by_operation.clear()


class StoppableProxy:
    """A TCP forwarder on 127.0.0.1 in front of the S3 endpoint that a test can stop and restart.

    Stopped, it refuses connections and cuts open ones: S3 is "down" as far as the tier can tell.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []  # guarded by _lock
        self._listener: socket.socket | None = None
        self.port = 0
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(
            target=self._accept, args=(listener,), name="test-s3-proxy-accept", daemon=True
        ).start()

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            # shutdown() wakes the accept() blocked in the other thread; close() alone may not.
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(
                    target=self._pump, args=(src, dst), name="test-s3-proxy-pump", daemon=True
                ).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
