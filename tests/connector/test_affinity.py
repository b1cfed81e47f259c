"""Specification: the connector's threads leave the core vLLM bound the engine thread to.

vLLM's CPU worker binds its main thread to a core and every thread started from it inherits that;
a connector thread (save, heartbeat, reconnect, load) must instead take the worker's parent
process's other CPUs, so it never waits behind the engine thread, which spins on its core between
steps (or behind another engine bound to the same core: measured up to 15 s, longer than the
server's heartbeat timeout)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.connector.affinity import background_cpus, describe_binding, spread_current_thread
from tiercache.wire.client import Client

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(os.getppid())) < 2,
    reason="needs Linux CPU affinity and a parent process allowed on at least 2 CPUs",
)


def on_thread(body: Callable[[], object]) -> object:
    """Run ``body`` on a fresh thread and return its result (affinity is per thread on Linux)."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(body()))
    t.start()
    t.join(10)
    return out[0]


def pinned_to_one_cpu(then: Callable[[], object]) -> Callable[[], object]:
    def body() -> object:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(os.getppid()))})  # as vLLM binds its worker
        return then()

    return body


def test_a_thread_bound_to_one_core_moves_onto_the_parent_process_other_cpus() -> None:
    def spread() -> tuple[set[int] | None, str | None, set[int]]:
        wider, line = background_cpus(), describe_binding()
        spread_current_thread()
        return wider, line, os.sched_getaffinity(0)

    wider, line, after = on_thread(pinned_to_one_cpu(spread))  # type: ignore[misc]
    parent = os.sched_getaffinity(os.getppid())
    others = parent - {min(parent)}  # off the engine thread's core (where vLLM's worker spins)
    assert wider == others
    assert after == others
    assert line is not None and "the engine thread is bound to CPUs [" in line


def test_a_thread_no_narrower_than_its_parent_is_left_alone() -> None:
    def body() -> tuple[set[int] | None, str | None, set[int]]:
        os.sched_setaffinity(0, os.sched_getaffinity(os.getppid()))
        before = os.sched_getaffinity(0)
        spread_current_thread()
        assert os.sched_getaffinity(0) == before
        return background_cpus(), describe_binding(), before

    wider, line, _ = on_thread(body)  # type: ignore[misc]
    assert wider is None and line is None


def test_the_client_runs_its_hook_first_on_its_heartbeat_thread(tmp_path: Path) -> None:
    server = ServerProcess(ServerSpec(listen=f"ipc://{tmp_path}/server.sock", options={"chunk_size": 256}))
    try:
        server.wait_ready()
        heartbeat_thread_is_moved(server)
    finally:
        server.stop()


def heartbeat_thread_is_moved(server: ServerProcess) -> None:
    seen: list[tuple[str, set[int]]] = []
    done = threading.Event()

    def hook() -> None:
        spread_current_thread()
        seen.append((threading.current_thread().name, os.sched_getaffinity(0)))
        done.set()

    def connect() -> None:
        # Created on a thread bound to one core: the heartbeat thread inherits that binding, and
        # the hook moves it.
        Client(server.endpoint, timeout=5, on_thread_start=hook).close()

    on_thread(pinned_to_one_cpu(lambda: connect()))
    assert done.wait(10)
    [(name, cpus)] = seen
    assert name == "tiercache-client-heartbeat"
    parent = os.sched_getaffinity(os.getppid())
    assert cpus == parent - {min(parent)}
