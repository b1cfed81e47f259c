"""Run a tiercache server from a :class:`~tiercache.config.ServerConfig`: the programmatic ``run()``.

Separate from the CLI (which only parses flags and maps errors to exit codes), like uvicorn's
``uvicorn.run``. The lifecycle:

1. build the engine (tiers are created and checked: ``/dev/shm``, disk directory, bucket),
2. start the metrics endpoint if ``--metrics-port`` is set,
3. start the server and log where it listens, where it stores and its budgets,
4. serve until stopped. The first SIGINT/SIGTERM stops accepting and drains in-flight work for up to
   ``drain_timeout_s`` (on a helper thread: the signal handler must return so the serving loop can
   finish); a second signal forces exit with status 130,
5. stop metrics and close the engine, which flushes its write-through queues and closes every tier.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from tiercache.config.server import ServerConfig
from tiercache.errors import ConfigError
from tiercache.server.app import Server
from tiercache.server.build import build_engine
from tiercache.server.metrics import MetricsServer

log = logging.getLogger(__name__)

#: Exit status of a forced exit (second signal), as shells report SIGINT.
FORCED_EXIT_STATUS = 130


def run(config: ServerConfig, *, handle_signals: bool = True) -> None:
    """Build the engine, serve until stopped, then close everything. Blocks.

    ``handle_signals`` installs the SIGINT/SIGTERM handlers described in the module docstring (only
    possible on the main thread; elsewhere the caller stops the server itself). Raises
    :class:`~tiercache.errors.TierCacheError` subclasses for start-up failures, never exits the
    process except on a second signal.
    """
    engine = build_engine(config)
    try:
        # Built (not started) first: metrics export its lookup latencies beside the engine's stats.
        server = Server(engine, config.server)
    except BaseException:
        engine.close(timeout=config.server.drain_timeout_s)
        raise
    # Handlers go in before start() and stay until the tiers are closed: a signal during start-up
    # must drain too, and a second one while the tiers close must force the exit, never raise
    # KeyboardInterrupt into a half-closed engine (whose worker threads would then keep the
    # process alive).
    guard = _signal_handlers(server, config.server.drain_timeout_s) if handle_signals else None
    with guard if guard is not None else contextlib.nullcontext():
        metrics: MetricsServer | None = None
        try:
            if config.server.metrics_port is not None:
                metrics = MetricsServer(server.metrics_stats, config.metrics_host, config.server.metrics_port)
                try:
                    metrics.start()
                except OSError as exc:
                    raise ConfigError(
                        f"--metrics-port {config.server.metrics_port}: cannot listen on "
                        f"{config.metrics_host}:{config.server.metrics_port} ({exc.strerror or exc}); "
                        "choose a free port, or 0 for any"
                    ) from exc
            server.start()
            _log_started(config, server, metrics)
            server.serve_forever()
            log.info("server stopped; closing tiers")
        finally:
            if metrics is not None:
                metrics.stop()
            engine.close(timeout=config.server.drain_timeout_s)
    log.info("bye")


def _log_started(config: ServerConfig, server: Server, metrics: MetricsServer | None) -> None:
    """One line saying where it listens, then the configuration summary (no secrets)."""
    # ``endpoint`` is the bound address (the real port for tcp://HOST:0).
    log.info("tiercache server ready on %s", server.endpoint)
    arena = server.arena.name
    for line in config.describe().splitlines():
        if line.startswith("metrics:") and metrics is not None:
            line = f"metrics: {metrics.url}"  # the bound port, when 0 asked for any free one
        elif line.startswith("l1:"):
            line = line.replace("<unique name>", arena)  # the name workers attach to
        log.info("  %s", line)


@contextlib.contextmanager
def _signal_handlers(server: Server, drain_timeout_s: float) -> Iterator[None]:
    """SIGINT/SIGTERM: first drains (``server.stop`` on a thread), second forces exit."""
    if threading.current_thread() is not threading.main_thread():
        log.debug("not on the main thread: signal handlers not installed")
        yield
        return
    stopping = threading.Event()

    def handle(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if stopping.is_set():
            log.warning("%s again: forcing exit without draining", name)
            if server.arena.owner:
                server.arena.unlink()  # os._exit skips cleanup: do not leak the arena's /dev/shm memory
            logging.shutdown()
            os._exit(FORCED_EXIT_STATUS)
        stopping.set()
        log.warning(
            "%s: shutting down, draining (timeout %gs)… (send it again to force exit)",
            name,
            drain_timeout_s,
        )
        threading.Thread(
            target=server.stop, args=(drain_timeout_s,), name="tiercache-shutdown", daemon=True
        ).start()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
