"""Specification: the connector's link to the server goes down on a failure and comes back on its own.

While the server is away the link keeps a ping outstanding (ZMQ queues it until the server's socket
is back), so a restarted server is found as soon as it answers, not ``retry_s`` later (on ``unix://``,
where there is no ping to queue, it tries every 0.1 s while nothing listens). Failures that
repeat while the server answers pings back off, so they cannot take the link up and down (and warn)
at every call."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.client import link as link_module
from tiercache.client.client import Client
from tiercache.client.link import FIRST_RETRY_S, ServerLink, retry_delays
from tiercache.config.connector import ConnectorSettings
from tiercache.errors import ServerUnavailableError
from tiercache.testing.poll import wait_until


def server_spec(tmp_path: Path) -> ServerSpec:
    return ServerSpec(listen=f"ipc://{tmp_path}/server.sock", options={"chunk_size": 256})


def ready_server(spec: ServerSpec) -> ServerProcess:
    """A server process started from ``spec`` that has answered a hello."""
    server = ServerProcess(spec)
    server.wait_ready()
    return server


def recorded_pauses(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The pauses every link takes from now on, each recorded as the link starts it."""
    pauses: list[float] = []

    def recorded(retry_s: float) -> Iterator[float]:
        for pause in retry_delays(retry_s):
            pauses.append(pause)
            yield pause

    monkeypatch.setattr(link_module, "retry_delays", recorded)
    return pauses


def test_pauses_start_at_half_a_second_and_double_up_to_retry_s() -> None:
    assert FIRST_RETRY_S == 0.5
    assert list(itertools.islice(retry_delays(5.0), 6)) == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert list(itertools.islice(retry_delays(0.2), 3)) == [0.2, 0.2, 0.2]


def test_a_restarted_server_is_found_as_soon_as_it_answers_not_retry_s_later(tmp_path: Path) -> None:
    spec = server_spec(tmp_path)
    server = ready_server(spec)
    connects: list[Client] = []
    # retry_s far beyond this test's deadline: a link that waited it out between attempts fails here.
    settings = ConnectorSettings(server=spec.listen, timeout_s=1.0, retry_s=600.0)
    link = ServerLink(settings, "test-link", connects.append)
    try:
        assert link.start() and link.up and len(connects) == 1
        server.stop()
        client = link.client()
        assert client is not None
        try:
            client.ping(timeout=0.5)
        except ServerUnavailableError as exc:
            link.failed("ping", exc)
        assert not link.up and link.client() is None and link.outages == 1
        # The server stays away for a few of the link's attempts (each listens timeout_s).
        with pytest.raises(TimeoutError):
            wait_until(lambda: link.up, timeout=3.0, what="the link to stay down while the server is away")
        server = ready_server(spec)
        ready = time.monotonic()
        wait_until(lambda: link.up, timeout=30.0, what="the link to notice the restarted server")
        print(f"link up {time.monotonic() - ready:.3f} s after the restarted server answered")
        assert len(connects) == 2  # the layout is registered again on the new server
        client = link.client()
        assert client is not None
        client.ping()
    finally:
        link.close()
        server.stop()


def test_failures_while_the_server_answers_back_off_instead_of_flapping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (No wall-clock bound: the machines are shared, a count of reconnects in so many seconds is a
    # count of how busy the host was.)
    pauses = recorded_pauses(monkeypatch)
    spec = server_spec(tmp_path)
    server = ready_server(spec)
    connects: list[Client] = []
    settings = ConnectorSettings(server=spec.listen, timeout_s=2.0, retry_s=5.0)
    link = ServerLink(settings, "test-link", connects.append)
    try:
        assert link.start() and len(connects) == 1
        for n in range(1, 4):  # every call fails (say, a server error) as soon as the link is up
            link.failed("lookup", ServerUnavailableError("refused"))
            assert not link.up
            wait_until(lambda n=n: link.up and len(connects) == n + 1, timeout=30.0, what=f"reconnect {n}")
        # Each reconnect waited first, and longer each time: a link that reconnected at once (or
        # started its back-off afresh each time) would flap at every call of a failing server.
        assert pauses == [0.5, 1.0, 2.0]
        assert link.outages == 3
    finally:
        link.close()
        server.stop()


def test_a_server_down_at_start_is_found_once_it_starts(tmp_path: Path) -> None:
    spec = server_spec(tmp_path)
    settings = ConnectorSettings(server=spec.listen, timeout_s=1.0, retry_s=600.0)
    connects: list[Client] = []
    link = ServerLink(settings, f"test-link-{os.getpid()}", connects.append)
    server: ServerProcess | None = None
    try:
        assert not link.start()  # the engine starts anyway, without the cache
        server = ready_server(spec)
        wait_until(lambda: link.up, timeout=30.0, what="the link to notice the server's start")
        assert len(connects) == 1
    finally:
        link.close()
        if server is not None:
            server.stop()


def test_on_unix_a_server_that_starts_late_is_looked_for_without_backing_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On unix:// a connection to nobody fails at once, with no ping to queue: a link that backed
    # off there (0.5, 1, 2, 4 s ...) would find a server that starts during a pause only after it.
    pauses = recorded_pauses(monkeypatch)
    spec = ServerSpec(listen=f"unix://{tmp_path}/run/server.sock", options={"chunk_size": 256})
    settings = ConnectorSettings(server=spec.listen, timeout_s=1.0, retry_s=600.0)
    connects: list[Client] = []
    link = ServerLink(settings, f"test-link-{os.getpid()}", connects.append)
    server: ServerProcess | None = None
    try:
        assert not link.start()
        with pytest.raises(TimeoutError):  # nobody listens for a while: attempts, no pause taken
            wait_until(lambda: link.up, timeout=2.0, what="the link to stay down while nothing listens")
        server = ready_server(spec)
        wait_until(lambda: link.up, timeout=30.0, what="the link to notice the server's start")
        assert len(connects) == 1
        assert pauses == []
    finally:
        link.close()
        if server is not None:
            server.stop()
