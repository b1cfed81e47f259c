"""Run a real tiercache server in its own process (spawned), built from plain arguments.

The entry function is what a test hands to ``multiprocessing``; :class:`ServerProcess` starts it and
waits for readiness by polling with hello round trips while the process is alive, never by sleeping.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiercache.client.client import Client
from tiercache.errors import ServerUnavailableError

MiB = 1 << 20


@dataclass
class ServerSpec:
    """What to build in the server process: tiers and server options (all picklable)."""

    listen: str
    l1_bytes: int = 16 * MiB
    disk_path: str | None = None
    disk_budget: int = 64 * MiB
    s3_url: str | None = None
    s3_bucket: str = "tiercache-server-test"
    options: dict[str, Any] = field(default_factory=dict)
    l1_lease_ttl_s: float = 60.0
    #: Extra fields of L1Config (tenant quotas).
    l1_options: dict[str, Any] = field(default_factory=dict)
    #: Extra fields of DiskConfig / S3Config / EngineConfig (e.g. short S3 timeouts, a tiny budget).
    disk_options: dict[str, Any] = field(default_factory=dict)
    s3_options: dict[str, Any] = field(default_factory=dict)
    engine_options: dict[str, Any] = field(default_factory=dict)
    #: TESTING ONLY: wrap lower tiers in a FaultInjectingTier, by tier name ("disk", "s3") → FaultPlan
    #: fields. Exists only in this test harness; no CLI flag or setting enables it in a real server.
    faults: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Added to the server process's nice value before it builds anything (its threads inherit
    #: it): negative runs it ahead of its clients on busy cores, and needs CAP_SYS_NICE.
    nice: int = 0


def serve(spec: ServerSpec, stop: multiprocessing.synchronize.Event) -> None:
    """Process entry: build the engine and server, serve until ``stop`` is set, then stop cleanly."""
    from tiercache.config import (
        DiskConfig,
        EngineConfig,
        L1Config,
        S3Config,
        ServerOptions,
    )
    from tiercache.engine import TieredEngine
    from tiercache.l1.tier import L1Tier
    from tiercache.server import Server
    from tiercache.tier import Tier

    if spec.nice:
        os.nice(spec.nice)
    l1 = L1Tier(
        # The default arena name carries the server's pid, so an arena left by a server a test
        # killed with SIGKILL is reclaimed when the next server starts.
        L1Config(size_bytes=spec.l1_bytes, name=None, lease_ttl_s=spec.l1_lease_ttl_s, **spec.l1_options)
    )
    lower: list[Tier] = []
    if spec.disk_path is not None:
        from tiercache.l2_disk import DiskTier

        lower.append(
            DiskTier(
                DiskConfig(path=Path(spec.disk_path), budget_bytes=spec.disk_budget, **spec.disk_options)
            )
        )
    if spec.s3_url is not None:
        from tiercache.l3_s3 import S3Tier

        lower.append(
            S3Tier(
                S3Config(
                    bucket=spec.s3_bucket,
                    endpoint_url=spec.s3_url,
                    region="us-east-1",
                    path_style=True,
                    create_bucket=True,
                    **spec.s3_options,
                )
            )
        )
    if spec.faults:
        from tiercache.testing.faults import FaultInjectingTier, FaultPlan

        unknown = set(spec.faults) - {t.name for t in lower}
        if unknown:
            raise ValueError(f"faults for tiers this server does not have: {sorted(unknown)}")
        lower = [
            FaultInjectingTier(t, FaultPlan(**spec.faults[t.name])) if t.name in spec.faults else t
            for t in lower
        ]
    engine = TieredEngine(l1, lower, EngineConfig(**spec.engine_options))
    server = Server(engine, ServerOptions(listen=spec.listen, **spec.options))
    server.start()
    try:
        stop.wait()
    finally:
        server.stop(5.0)


class ServerProcess:
    """A spawned server process; :meth:`client` connects to it."""

    def __init__(self, spec: ServerSpec) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.spec = spec
        self._stop = ctx.Event()
        self.process = ctx.Process(
            target=serve, args=(spec, self._stop), name="tiercache-test-server", daemon=True
        )
        self.process.start()

    @property
    def endpoint(self) -> str:
        return self.spec.listen

    def wait_ready(self, deadline_s: float = 60.0, **client_kw: Any) -> None:
        """Poll with hello round trips until the server answers (or its process died)."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if not self.process.is_alive():
                raise RuntimeError(f"server process exited with {self.process.exitcode}")
            try:
                Client(self.endpoint, timeout=0.5, heartbeat=False, **client_kw).close()
                return
            except ServerUnavailableError:
                time.sleep(0.02)  # (on unix:// said at once while nothing listens yet)
                continue
        raise RuntimeError("server did not answer in time")

    def client(self, **kw: Any) -> Client:
        kw.setdefault("timeout", 10.0)
        return Client(self.endpoint, **kw)

    def stop(self) -> int | None:
        """Ask for a clean stop and wait for the process to exit."""
        if self.process.is_alive():
            # Never set the event for a killed process: one killed inside ``stop.wait()`` leaves the
            # event's condition counting a sleeper that never wakes, and ``set()`` would wait forever.
            self._stop.set()
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        return self.process.exitcode
