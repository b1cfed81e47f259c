"""Helpers every benchmark here uses the same way: progress lines, percentiles, a process's CPU
time, stopping a server it started, and where engines and cache servers run (every system alike).
Standard library only, so each benchmark keeps its own imports."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def progress(name: str) -> Callable[[str], None]:
    """A function printing ``[name HH:MM:SS] message`` on stderr (stdout is kept for the tables)."""

    def log(msg: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    return log


def pct(samples: list[float], q: float) -> float:
    """The sample at quantile ``q`` (0..1) of ``samples``: the nearest rank, not interpolated."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and its live descendants, from /proc (Linux): a cache
    server copying or writing stores is busy, one waiting for requests is not."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        child = int(entry.name)
        children.setdefault(int(fields[1]), []).append(child)
        times[child] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += times.get(p, 0.0)
        todo += children.get(p, [])
    return total


def stop_process(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM (the cache servers drain and stop on it), SIGKILL after 30 s."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def cpu_set(spec: str) -> set[int]:
    """The CPUs of a list such as ``0``, ``0-3`` or ``0,2-3``."""
    out: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


#: ``--pin``'s choices: where the vLLM servers, the cache servers and the load generator run.
PIN_CHOICES = ("all", "engine", "none")
PIN_HELP = (
    "where each process runs, the same for every system: 'all' runs every vLLM server (front-end, "
    "scheduler, worker and the connector's threads in it) on --engine-cpus, 'engine' binds only the "
    "engines' compute threads there (VLLM_CPU_OMP_THREADS_BIND) and lets vLLM's other threads run on "
    "any CPU; with both, every cache server and the load generator run on the CPUs left (taskset). "
    "'none' pins nothing: a cache server's work (a write to disk for every chunk stored) then takes "
    "CPU time from the engine"
)


def add_pin_arguments(group: argparse._ActionsContainer) -> None:
    """``--pin`` (:data:`PIN_CHOICES`, default ``all``) and ``--no-pin`` (``--pin none``)."""
    group.add_argument("--pin", choices=PIN_CHOICES, default="all", help=PIN_HELP)
    group.add_argument(
        "--no-pin",
        dest="pin",
        action="store_const",
        const="none",
        default=argparse.SUPPRESS,
        help="--pin none",
    )


def placement(engine_cpus: str, pin: str) -> tuple[str | None, str | None]:
    """``(vLLM CPUs, cache CPUs)`` for ``taskset`` (:data:`PIN_CHOICES`): every vLLM process on
    ``engine_cpus`` (``all``) or on every CPU this process may use (``engine``: a vLLM server is
    started from the load generator's process, whose CPUs it would inherit), and every cache server
    (and the load generator) on the CPUs left; ``None`` where nothing is pinned (``none``, or
    ``auto`` CPUs). Raises :class:`ValueError` when no CPU is left."""
    if pin not in PIN_CHOICES:
        raise ValueError(f"--pin is one of {', '.join(PIN_CHOICES)}, got {pin!r}")
    if pin == "none" or engine_cpus == "auto":
        return None, None
    every = sorted(os.sched_getaffinity(0))
    rest = sorted(set(every) - cpu_set(engine_cpus))
    if not rest:
        raise ValueError(
            f"--pin {pin} needs a CPU besides --engine-cpus {engine_cpus} for the cache servers and the "
            "load generator; give the engines fewer CPUs or pass --pin none"
        )
    return (engine_cpus if pin == "all" else ",".join(map(str, every))), ",".join(map(str, rest))


def pinned(cmd: list[str], cpus: str | None) -> list[str]:
    """``cmd`` run on ``cpus`` (``taskset -c``), or as it is when ``cpus`` is None."""
    return ["taskset", "-c", cpus, *cmd] if cpus else cmd


def engine_env(engine_cpus: str) -> dict[str, str]:
    """What every vLLM engine's environment adds, whatever the system: its compute threads bound to
    ``engine_cpus`` (``VLLM_CPU_OMP_THREADS_BIND``). vLLM's CPU engine reserves one more CPU when a
    KV connector is configured and, on a small machine, then computes on every CPU; without a
    connector on one: unbound, a comparison with no connector sets two compute threads against one."""
    return {} if engine_cpus == "auto" else {"VLLM_CPU_OMP_THREADS_BIND": engine_cpus}


def tiercache_server_argv(
    python: str, endpoint: str, chunk: int, l1_gb: float, disk: Path | None
) -> list[str]:
    """``tiercache server`` as the serving benchmarks start it: L1 of ``l1_gb`` and, unless ``disk``
    is None, a 4 GB disk tier there (``--tiers l1,disk``); warnings only."""
    tiers = (
        ["--tiers", "l1"]
        if disk is None
        else ["--tiers", "l1,disk", "--disk-path", str(disk), "--disk-size-gb", "4"]
    )
    return [
        python,
        "-m",
        "tiercache.cli",
        "server",
        *tiers,
        "--listen",
        endpoint,
        "--chunk-size",
        str(chunk),
        "--l1-size-gb",
        str(l1_gb),
        "--log-level",
        "warning",
    ]


def _wait_ready(
    proc: subprocess.Popen[bytes],
    answers: Callable[[], bool],
    name: str,
    log: Path,
    deadline_s: float,
    pause_s: float,
) -> bool:
    """Poll ``answers()`` every ``pause_s`` until it is true (then return true) or ``deadline_s``
    passes (false); raise, naming ``log``, if ``proc`` (the ``name``) exits first."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}; see {log}")
        if answers():
            return True
        time.sleep(pause_s)
    return False


def wait_for_tiercache(
    proc: subprocess.Popen[bytes], endpoint: str, log: Path, deadline_s: float = 60.0
) -> None:
    """Return once the server ``proc`` answers a hello on ``endpoint``; raise, naming ``log``, if it
    exits first or does not answer within ``deadline_s``."""
    from tiercache.client.client import Client  # the checkout's, once the benchmark set sys.path
    from tiercache.errors import ServerUnavailableError

    def hello() -> bool:
        try:
            Client(endpoint, timeout=0.5, heartbeat=False).close()
        except ServerUnavailableError:
            return False
        return True

    if not _wait_ready(proc, hello, "tiercache server", log, deadline_s, 0.1):
        raise RuntimeError(f"tiercache server did not answer within {deadline_s:g} s; see {log}")


def tiercache_stats(endpoint: str) -> dict[str, Any]:
    """The server's ``stats`` (``engine``: stores, hits, promotions, evictions, ...)."""
    from tiercache.client.client import Client

    with Client(endpoint, timeout=5.0, heartbeat=False) as client:
        return dict(client.stats())


def lmcache_server_argv(
    python: str, chunk: int, l1_gb: float, port: int, shm_name: str, fs: Path | None
) -> list[str]:
    """``lmcache server`` (multiprocess mode, shared-memory transport, LRU) from ``python``'s venv, as
    the serving benchmarks start it; with ``fs``, its ``fs`` L2 adapter there."""
    cmd = [
        str(Path(python).parent / "lmcache"),
        "server",
        "--chunk-size",
        str(chunk),
        "--l1-size-gb",
        str(l1_gb),
        "--eviction-policy",
        "LRU",
        "--supported-transfer-mode",
        "engine_driven",
        "--port",
        str(port),
        "--shm-name",
        shm_name,
    ]
    if fs is not None:
        cmd += ["--l2-adapter", json.dumps({"type": "fs", "base_path": str(fs)})]
    return cmd


def wait_for_port(proc: subprocess.Popen[bytes], port: int, log: Path, deadline_s: float = 120.0) -> None:
    """Return once ``proc`` accepts connections on 127.0.0.1:``port``; raise, naming ``log``, if it
    exits first or does not listen within ``deadline_s``."""

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        except OSError:
            return False
        return True

    if not _wait_ready(proc, listening, "server", log, deadline_s, 0.2):
        raise RuntimeError(f"server did not listen on port {port} within {deadline_s:g} s; see {log}")
