"""The connector's connection to the tiercache server: best effort, never a stall.

:class:`ServerLink` owns one :class:`~tiercache.client.client.Client`. While the server answers, callers get
the client from :meth:`ServerLink.client`. When a call fails (server down, slow, restarted), the caller
reports it with :meth:`ServerLink.failed`: the link logs one warning, goes *down*, and a background
thread (``tiercache-connector-reconnect``) reconnects. It keeps a ping outstanding, one
``timeout_s`` after another: ZMQ queues the ping until the server's socket is back, so a returning
server is noticed as soon as it answers, however long the outage. On ``unix://``, where a
connection to nobody fails at once, it tries again every :data:`LISTEN_POLL_S` while nothing
listens, to the same end (a connect that fails costs microseconds). The first attempt after a failure,
and any attempt after one that failed at once (the server refused), waits a pause first: from
:data:`FIRST_RETRY_S`, doubling up to ``retry_s`` while the link keeps failing. While down,
:meth:`client` returns ``None`` at once, so the engine sees misses and skipped stores instead of
waiting on timeouts. On every (re)connect the ``on_connect`` callback runs (it re-registers the
layout; a restarted server may have forgotten it).

The connector's halves take a :data:`LinkFactory` (default: :class:`ServerLink`), so their unit tests
hand them a fake link instead of a thread and a socket.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from tiercache.client.affinity import background_cpus, spread_current_thread
from tiercache.client.client import Client
from tiercache.config.connector import ConnectorSettings
from tiercache.errors import ConfigError, ServerNotListeningError, TierCacheError

log = logging.getLogger(__name__)

#: The first pause before reconnecting; each further failure within ``retry_s`` of the last doubles
#: it, up to ``retry_s``.
FIRST_RETRY_S = 0.5

#: How often a link to a ``unix://`` endpoint where nothing listens tries again.
LISTEN_POLL_S = 0.1

#: What a half runs on every (re)connect, with the connected client.
OnConnect = Callable[[Client], None]


def retry_delays(retry_s: float) -> Iterator[float]:
    """Successive pauses before reconnect attempts: :data:`FIRST_RETRY_S`, doubling, then ``retry_s``
    for ever (``retry_s`` from the start when it is shorter)."""
    delay = min(FIRST_RETRY_S, retry_s)
    while True:
        yield delay
        delay = min(2 * delay, retry_s)


class Link(Protocol):
    """What the connector's halves need of their connection to the server (:class:`ServerLink`)."""

    outages: int

    def start(self) -> bool: ...
    def client(self) -> Client | None: ...
    def failed(self, what: str, exc: BaseException) -> None: ...
    def close(self) -> None: ...


#: Builds a half's link: ``(settings, client name, on_connect) -> Link``.
LinkFactory = Callable[[ConnectorSettings, str, OnConnect], Link]


class ServerLink:
    """A client that is either up (usable) or down (reconnecting in the background)."""

    def __init__(self, settings: ConnectorSettings, name: str, on_connect: OnConnect) -> None:
        self.settings = settings
        self._name = name
        self._on_connect = on_connect
        self._lock = threading.Lock()  # guards _client, _up
        self._client: Client | None = None
        self._up = False
        self._disabled: str | None = None
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.outages = 0  # times the link went down (for the connector's stats)
        # Taken here, on the engine thread: the client's libzmq I/O thread carries every request
        # and reply, so it must not share the engine thread's core either (see affinity).
        self._io_cpus = background_cpus()

    @property
    def endpoint(self) -> str:
        return self.settings.server or "the default socket"

    def start(self, *, raise_config_errors: bool = True) -> bool:
        """Connect once, synchronously (at engine start-up). A :class:`ConfigError` from
        ``on_connect`` (e.g. a chunk size that does not fit the engine) is raised; an unreachable
        server is logged and retried in the background. Returns whether the link is up."""
        try:
            self._connect()
        except ConfigError:
            if raise_config_errors:
                raise
        except TierCacheError as exc:
            log.warning(
                "tiercache: server at %s is not reachable (%s); running without the cache (all misses) "
                "and reconnecting in the background",
                self.endpoint,
                exc,
            )
        self._thread = threading.Thread(
            target=self._reconnect_loop, name="tiercache-connector-reconnect", daemon=True
        )
        self._thread.start()
        return self._up

    def _connect(self) -> None:
        s = self.settings
        with self._lock:
            if self._client is None:
                self._client = Client(
                    s.server,
                    timeout=s.timeout_s,
                    auth_secret=s.auth_secret,
                    client_name=self._name,
                    # The client may be built on the reconnect thread, already moved: its
                    # heartbeat thread goes where the engine thread's others go.
                    on_thread_start=lambda: spread_current_thread(self._io_cpus or set()),
                    io_cpus=self._io_cpus,
                )
            client = self._client
        try:
            client.ping()
            self._on_connect(client)
        except ConfigError as exc:
            self._disabled = str(exc)
            raise
        with self._lock:
            self._up = True
        log.info("tiercache: connected to %s (chunk size %d)", self.endpoint, client.server.chunk_size)

    def _reconnect_loop(self) -> None:
        spread_current_thread(self._io_cpus or set())
        pauses = retry_delays(self.settings.retry_s)
        while not self._closed.is_set() and self._disabled is None:
            if self._up:
                up_at = time.monotonic()
                self._wake.wait()  # set by failed() and close()
                self._wake.clear()
                if time.monotonic() - up_at >= self.settings.retry_s:
                    pauses = retry_delays(self.settings.retry_s)  # it was stable: back off afresh
                # A pause before the first attempt: a server that answers pings but fails calls
                # would otherwise take the link up and down (and warn) at every call.
                if self._closed.wait(next(pauses)):
                    return
                continue
            began = time.monotonic()
            try:
                self._connect()
                continue
            except ConfigError as exc:
                log.error("tiercache: the connector is disabled: %s", exc)
                return
            except ServerNotListeningError:
                # Nobody to refuse us, and nobody to queue a ping for: look again shortly, as a
                # ping queued by ZMQ would find the server as soon as it listens.
                if self._closed.wait(LISTEN_POLL_S):
                    return
                continue
            except TierCacheError as exc:
                log.debug("tiercache: server at %s still unreachable: %s", self.endpoint, exc)
            # A server that is down costs an attempt its whole timeout_s (the ping waited, queued, for
            # it to come back): listen again at once. An attempt that failed sooner pauses first.
            if time.monotonic() - began < self.settings.timeout_s and self._closed.wait(next(pauses)):
                return

    def client(self) -> Client | None:
        """The client while the server is up; ``None`` (at once) while it is down."""
        return self._client if self._up else None

    @property
    def up(self) -> bool:
        return self._up

    def failed(self, what: str, exc: BaseException) -> None:
        """Report a failed call: warn once per outage, go down, reconnect in the background."""
        with self._lock:
            was_up, self._up = self._up, False
        if was_up:
            self.outages += 1
            log.warning(
                "tiercache: %s failed (%s: %s); treating the cache as unavailable (misses, no stores) "
                "and reconnecting to %s in the background",
                what,
                type(exc).__name__,
                exc,
                self.endpoint,
            )
            self._wake.set()

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.settings.timeout_s + 1)
        with self._lock:
            client, self._client, self._up = self._client, None, False
        if client is not None:
            client.close()
