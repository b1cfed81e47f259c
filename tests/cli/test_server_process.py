"""`tiercache server` as a real process: starts, serves metrics, drains on a signal, forced by a second.

Needs the server package (``tiercache.server``); skipped where it is absent.
"""

from __future__ import annotations

import os
import queue
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tiercache.client.client import Client
from tiercache.testing.poll import wait_until

READY_TIMEOUT_S = 60


@dataclass
class ServerProcess:
    proc: subprocess.Popen[str]
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    seen: list[str] = field(default_factory=list)
    pump: threading.Thread | None = None

    def wait_for(self, pattern: str, timeout: float = READY_TIMEOUT_S) -> re.Match[str]:
        """Poll stderr lines until one matches ``pattern`` (readiness by polling, never by sleeping)."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        for line in self.seen:
            if m := regex.search(line):
                return m
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    break
                continue
            self.seen.append(line)
            if m := regex.search(line):
                return m
        raise AssertionError(f"no line matching {pattern!r}; stderr so far:\n{''.join(self.seen)}")

    def output(self) -> str:
        """Everything written to stderr so far (all of it once the process has exited)."""
        if self.proc.poll() is not None and self.pump is not None:
            self.pump.join(10)  # the pipe closes at exit; read it to the end
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return "".join(self.seen)


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[callable]:  # type: ignore[valid-type]
    started: list[ServerProcess] = []

    def start(*args: str, soft_nofile: int | None = None, default_listen: bool = False) -> ServerProcess:
        """``tiercache server ARGS`` on small tiers, listening on an ipc socket under ``tmp_path``
        (with ``default_listen``, where it listens by default: under ``$XDG_RUNTIME_DIR``)."""
        listen = [] if default_listen else ["--listen", f"ipc://{tmp_path / 'server.sock'}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERCACHE_")}
        env["XDG_DATA_HOME"] = str(tmp_path / "data")
        env["XDG_RUNTIME_DIR"] = str(tmp_path / "run")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tiercache.cli",
                "server",
                "--l1-size-gb",
                "0.01",
                "--disk-size-gb",
                "0.01",
                *listen,
                *args,
            ],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=env,
            # As systemd starts a service: a soft limit of open descriptors below the hard one.
            preexec_fn=None
            if soft_nofile is None
            else lambda: resource.setrlimit(
                resource.RLIMIT_NOFILE, (soft_nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
            ),
        )
        server = ServerProcess(proc)

        def pump() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                server.lines.put(line)

        server.pump = threading.Thread(target=pump, name="stderr-pump", daemon=True)
        server.pump.start()
        started.append(server)
        return server

    yield start
    for server in started:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(10)


def test_default_server_starts_serves_metrics_and_drains_on_sigterm(  # type: ignore[no-untyped-def]
    start_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = start_server("--metrics-port", "0", "--drain-timeout-s", "5", default_listen=True)
    socket_file = tmp_path / "run" / "tiercache" / "server.sock"  # the per-user default, over unix://
    server.wait_for(rf"tiercache server ready on unix://{re.escape(str(socket_file))}")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    with Client(heartbeat=False) as client:  # a client's default endpoint is the server's
        assert client.endpoint == f"unix://{socket_file}"
        client.ping()
    disk = server.wait_for(r"disk: +0\.01 GiB in (\S+)")
    assert disk.group(1) == str(tmp_path / "data" / "tiercache" / "disk")  # the per-user default
    url = server.wait_for(r"metrics: (http://127\.0\.0\.1:\d+/metrics)").group(1)
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    assert 'tiercache_tier_budget_bytes{tier="disk"}' in text

    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0, server.output()
    out = server.output()
    assert "SIGTERM: shutting down, draining (timeout 5s)" in out
    assert "Traceback" not in out
    assert not any(
        p.name.startswith("tiercache-") for p in Path("/dev/shm").iterdir() if str(server.proc.pid) in p.name
    ), "the L1 arena was not unlinked"


def test_two_signals_at_once_end_the_server_without_hanging(start_server) -> None:  # type: ignore[no-untyped-def]
    server = start_server()
    server.wait_for(r"tiercache server ready on")
    server.proc.send_signal(signal.SIGINT)
    server.proc.send_signal(signal.SIGINT)
    code = server.proc.wait(30)
    # The second signal normally lands while the first is still draining (exit 130); if the drain
    # already finished, the server exited cleanly (0). Either way it never hangs or crashes. That a
    # second signal does force the exit is the next test's (an idle server's drain may win the race).
    assert code in (0, 130), server.output()
    assert "Traceback" not in server.output()


#: A process with the server's signal handlers around a server whose drain never ends.
STUCK_DRAIN = """
import logging, sys, threading, time
from tiercache.server.run import _signal_handlers

logging.basicConfig(level=logging.INFO, stream=sys.stderr)

class Arena:
    owner = True
    def unlink(self):
        print("arena unlinked", file=sys.stderr, flush=True)

class StuckServer:
    arena = Arena()
    def stop(self, timeout):
        threading.Event().wait()  # in-flight work that never finishes

with _signal_handlers(StuckServer(), 5.0):
    print("handlers installed", file=sys.stderr, flush=True)
    while True:
        time.sleep(0.05)
"""


def test_a_second_signal_forces_exit_while_the_drain_is_still_running() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK_DRAIN], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )
    server = ServerProcess(proc)

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            server.lines.put(line)

    server.pump = threading.Thread(target=pump, name="stderr-pump", daemon=True)
    server.pump.start()
    try:
        server.wait_for(r"handlers installed")
        proc.send_signal(signal.SIGINT)
        server.wait_for(r"SIGINT: shutting down, draining")  # the drain runs, and cannot end
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the second signal did not force the exit:\n{server.output()}") from None
        out = server.output()
        assert code == 130, out
        assert "SIGINT again: forcing exit without draining" in out
        assert "arena unlinked" in out  # os._exit skips cleanup: the handler unlinks the arena itself
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_secrets_are_never_printed(start_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server = start_server("--listen", "tcp://127.0.0.1:0", "--auth-secret", "hunter2-secret-5b0e9c1d7a3f8462")
    server.wait_for(r"tiercache server ready on tcp://127\.0\.0\.1:\d+")
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(30)
    out = server.output()
    assert "hunter2-secret-5b0e9c1d7a3f8462" not in out
    assert "shared secret" in out


def test_a_weak_secret_stops_the_server_at_start_saying_how_to_make_one(start_server) -> None:  # type: ignore[no-untyped-def]
    # `tiercache2024` fell to an offline guesser in 1,436 guesses from one recorded handshake.
    server = start_server("--listen", "tcp://127.0.0.1:0", "--auth-secret", "tiercache2024")
    assert server.proc.wait(30) != 0
    out = server.output()
    assert "128 bits" in out and "openssl rand -hex 32" in out
    assert "tiercache2024" not in out


def test_metrics_histograms_time_lookups_and_tier_transfers(start_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client.parser import text_string_to_metric_families

    from tests.server.conftest import manifest
    from tests.server.test_data_path import prompt_hashes, store_prompt

    def counts(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every histogram's ``_count`` sample, by metric and labels."""
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            if family.type == "histogram"
            for s in family.samples
            if s.name.endswith("_count")
        }

    lookups = "tiercache_lookup_duration_seconds_count"
    transfers = "tiercache_tier_transfer_duration_seconds_count"
    server = start_server("--metrics-port", "0")
    url = server.wait_for(r"metrics: (http://127\.0\.0\.1:\d+/metrics)").group(1)
    server.wait_for(r"tiercache server ready on ipc://")
    before = counts(url)
    # Every label set is exported from the start, at zero, so a dashboard never shows "no data".
    assert before[(lookups, (("outcome", "hit"),))] == 0
    assert before[(transfers, (("op", "write"), ("tier", "disk")))] == 0

    with Client(f"ipc://{tmp_path / 'server.sock'}", timeout=10) as client:
        [group] = client.register([(0, manifest())])
        store_prompt(client, group, prompt_hashes(3))
        assert client.lookup(prompt_hashes(3), [group], prefetch=False).chunks == 3
        assert client.lookup(prompt_hashes(2, seed=7), [group], prefetch=False).chunks == 0
        wait_until(  # write-through is asynchronous
            lambda: counts(url)[(transfers, (("op", "write"), ("tier", "disk")))] >= 3,
            what="the disk writes to be timed",
        )

    after = counts(url)
    assert after[(lookups, (("outcome", "hit"),))] == 1
    assert after[(lookups, (("outcome", "miss"),))] == 1
    assert after[(transfers, (("op", "write"), ("tier", "l1")))] == 3  # the three commits
    assert after[(transfers, (("op", "read"), ("tier", "l1")))] >= 3  # pinned for the write-through
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0, server.output()


@pytest.mark.skipif(
    resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2048,
    reason="the hard limit of descriptors is too low here",
)
def test_silent_connections_past_the_soft_descriptor_limit_do_not_lock_a_client_out(start_server) -> None:  # type: ignore[no-untyped-def]
    """Started with a soft limit of 256 descriptors (hard: this machine's), the server raises its
    own to the hard limit: 400 connections that never say a word do not keep a client out, and
    libzmq closes them once the handshake time has passed."""

    secret = "test-secret-" + "0f9a27c4e1b8d6a3" * 2
    server = start_server("--listen", "tcp://127.0.0.1:0", "--auth-secret", secret, soft_nofile=256)
    endpoint = server.wait_for(r"tiercache server ready on (tcp://\S+)").group(1)
    assert "open-descriptor limit raised from 256" in server.output()
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    silent = [socket.create_connection((host, int(port)), timeout=5) for _ in range(400)]
    try:
        with Client(endpoint, timeout=10, auth_secret=secret, heartbeat=False) as client:
            client.ping()
    finally:
        for s in silent:
            s.close()
