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
from tiercache.client.affinity import background_cpus, describe_binding, spread_current_thread
from tiercache.client.client import Client

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


def new_zmq_threads(before: set[int]) -> dict[int, set[int]]:
    """This process's libzmq background threads (I/O, reaper) not in ``before``, with their CPUs."""
    found: dict[int, set[int]] = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        if name.startswith("ZMQbg/") and tid not in before:
            found[tid] = os.sched_getaffinity(tid)
    return found


def test_the_clients_zmq_io_thread_runs_on_the_cpus_it_is_given(tmp_path: Path) -> None:
    """libzmq's I/O thread carries every request and reply. Started from the engine thread it would
    inherit that thread's core, where a commit was measured waiting 5 s behind the spinning workers."""
    server = ServerProcess(ServerSpec(listen=f"ipc://{tmp_path}/server.sock", options={"chunk_size": 256}))
    started: dict[int, set[int]] = {}

    def connect() -> None:
        before = set(map(int, os.listdir("/proc/self/task")))
        client = Client(server.endpoint, timeout=5, heartbeat=False, io_cpus=background_cpus())
        try:
            client.ping()
            started.update(new_zmq_threads(before))
        finally:
            client.close()

    try:
        server.wait_ready()
        on_thread(pinned_to_one_cpu(connect))
    finally:
        server.stop()
    parent = os.sched_getaffinity(os.getppid())
    assert started
    assert all(cpus == parent - {min(parent)} for cpus in started.values())


def test_a_thread_started_from_an_already_moved_thread_gets_the_engine_threads_others_not_its_core() -> None:
    """The reconnect thread (moved) may build the client, whose heartbeat thread inherits the moved
    binding: relative to it the "other" CPUs are the engine thread's, so the CPUs are worked out
    once, on the engine thread, and handed down."""

    def body() -> tuple[set[int], set[int] | None, set[int] | None]:
        others = background_cpus()  # on the engine thread

        def reconnect_thread() -> tuple[set[int], set[int] | None]:
            spread_current_thread(others)
            relative = background_cpus()  # what a thread of its own would compute

            def heartbeat_thread() -> set[int]:
                spread_current_thread(others)
                return os.sched_getaffinity(0)

            return on_thread(heartbeat_thread), relative  # type: ignore[return-value]

        child, relative = on_thread(reconnect_thread)  # type: ignore[misc]
        return child, relative, others

    child, relative, others = on_thread(pinned_to_one_cpu(body))  # type: ignore[misc]
    parent = os.sched_getaffinity(os.getppid())
    assert others == parent - {min(parent)}
    assert child == others
    assert relative == {min(parent)}  # the engine's own core: why the CPUs are handed down
