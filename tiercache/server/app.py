"""The tiercache server: one per node, owning the engine and speaking :mod:`tiercache.wire.protocol`.

Threads:

* ``tiercache-server-loop`` — the request loop. Owns the ROUTER socket (on ``unix://``, the
  listener and its connections: :mod:`tiercache.server.unix`) and every piece of per-client
  state (:mod:`tiercache.server.sessions`; no lock needed: only this thread touches it). Does only
  in-memory work: decoding, L1 reservations/pins/commits (L1 never blocks on I/O), bookkeeping, and
  the lookups L1 answers alone (every object of every chunk asked for is in L1).
* ``tiercache-server-io-N`` — a bounded executor (``io_workers``) for anything that may touch L2/L3:
  other lookups, promotions, gets, stats, listing, explain, clear, warm, manifest registration. A
  finished job puts its result on a queue and writes one byte to a wake-up pipe that the loop polls
  beside the socket; the loop then builds and sends the reply. Jobs never touch per-client state.

The requests themselves are handled by :mod:`tiercache.server.data_ops` (the data path) and
:mod:`tiercache.server.management_ops` (stats, listing, explain, clear, warm); this module is the
transport, the dispatch and the lifecycle.

Lifecycle like uvicorn's: :meth:`Server.start` binds and starts the loop; :meth:`Server.serve_forever`
blocks until :meth:`Server.stop`, which stops accepting requests, drains in-flight jobs, releases every
client's reservations and leases, flushes the engine and closes the tiers. No signal handling and no
``sys.exit`` here: the CLI owns both.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import zmq

from tiercache.config.parts import ServerOptions
from tiercache.engine import TieredEngine
from tiercache.errors import ConfigError, ServerError
from tiercache.l1.arena import SharedArena
from tiercache.l1.front import ArenaFront
from tiercache.l1.tier import L1Tier
from tiercache.server.connections import map_large_buffers, peer_of, raise_descriptor_limit
from tiercache.server.data_ops import DataOps
from tiercache.server.events import ResidencyLog, chain_removals
from tiercache.server.hellos import FailedHellos
from tiercache.server.layouts import Layouts
from tiercache.server.management_ops import ManagementOps
from tiercache.server.records import EvictionRecord
from tiercache.server.replies import Handler, Refused, error_reply, request_keys
from tiercache.server.security import prepare_socket, secure_socket, setup_curve
from tiercache.server.sessions import Session, Sessions
from tiercache.server.tenants import TenantLookups, with_tenants
from tiercache.server.unix import IDENTITY_PREFIX, EpollPoller, Message, UnixListener
from tiercache.wire import protocol as p
from tiercache.wire.auth import TAG_BYTES
from tiercache.wire.codec import Codec
from tiercache.wire.frames import REQUEST_FRAME_BYTES, request_of
from tiercache.wire.stream import UNIX_SCHEME

log = logging.getLogger(__name__)

#: In-flight executor jobs allowed per I/O worker before new ones get ``busy`` (bounds memory and
#: queueing delay; a scheduler would rather recompute than wait behind a deep queue).
_JOBS_PER_WORKER = 64
#: The most a peer without a session may send in one message: a challenge or a hello is a few
#: hundred bytes. Anything more is read and freed frame by frame, never joined or decoded (msgpack
#: expands ~9x in objects), and refused.
_HANDSHAKE_MESSAGE_BYTES = 16 * 1024
#: Frames libzmq queues per connection before it stops reading that peer's socket (backpressure,
#: nothing dropped): with the loop dropping strangers' frames unread, this bounds what one
#: connection can have the server hold.
_RCVHWM = 64
#: ZMTP heartbeats on tcp: a peer silent for 3 of these loses its connection (and so its routing id).
_ZMTP_HEARTBEAT_MS = 2000
#: Milliseconds a tcp connection may take to finish its handshake before libzmq closes it.
_HANDSHAKE_MS = 5000
#: zmq's flags as plain ints: the enums' operators are Python calls, a few per message.
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)


@dataclass(slots=True)
class _Completion:
    identity: bytes
    req_id: int
    #: The executor's job, or ``None`` for a result computed on the loop (``result``).
    future: Future[Any] | None
    finish: Callable[[Any], p.Message | None]
    #: Called on the loop with the reply just sent (``None``: nothing was sent), e.g. to time it.
    sent: Callable[[p.Message | None], None] | None = None
    result: Any = None


class Server:
    """Serve ``engine`` on ``options.listen``. See the module docstring for threads and lifecycle.

    The server takes ownership of ``engine``: :meth:`stop` flushes and closes it.
    """

    def __init__(self, engine: TieredEngine, options: ServerOptions | None = None) -> None:
        if not isinstance(engine.l1, L1Tier):
            raise ConfigError(
                "the server needs an L1Tier (a shared arena) as the engine's first tier; build the engine with "
                "tiercache.server.build.build_engine() or pass L1Tier first"
            )
        self.engine = engine
        self.options = options or ServerOptions()
        self._l1: ArenaFront = engine.l1
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        #: The request loop's poller: the socket (or the ``unix://`` listener and its connections,
        #: on epoll) and the wake-up pipe.
        self._poller: zmq.Poller | EpollPoller = zmq.Poller()
        self._unix: UnixListener | None = None
        self._auth: Any = None
        self._thread: threading.Thread | None = None
        #: Why the request loop ended other than by :meth:`stop` (``None``: it did not).
        self.failure: BaseException | None = None
        self._executor = ThreadPoolExecutor(self.options.io_workers, thread_name_prefix="tiercache-server-io")
        self._max_inflight = self.options.io_workers * _JOBS_PER_WORKER
        self._completed: deque[_Completion] = deque()  # executor threads append, the loop pops
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self._stop_requested = threading.Event()
        self._stopped = threading.Event()
        self._lifecycle = threading.Lock()  # guards start/stop transitions
        self._started = False
        # Loop-thread state (no lock: only the loop thread reads or writes it).
        self._codec = Codec()
        self._sessions = Sessions(engine, self._l1, self.options)
        self._inflight = 0
        self._counters: dict[str, int] = {
            "requests": 0,
            "replies": 0,  # sent; fewer than requests by the quiet ones (a release nobody waits for)
            "errors": 0,
            "malformed": 0,
            "stranger_frames": 0,
        }
        self._hellos = FailedHellos()
        self._received = 0.0  # perf_counter() when the request being handled arrived
        self.evictions = EvictionRecord()
        #: What each tier gained and lost, for clients that follow it (KV events for routers).
        # A committed object lands in L1, then by write-behind in the first lower tier (if local).
        self.residency = ResidencyLog(local_tiers=[t.name for t in engine.tiers[:2] if not t.remote])
        self._follow_tiers()
        #: Lookups per tenant (what each tenant holds, the tiers count).
        self.tenant_lookups = TenantLookups()
        self._metric_tenants: set[str] = set()  # tenants metrics name (metrics thread only)
        data, management = self._request_ops()
        #: Seconds from a lookup's arrival to its reply's send, by outcome (observed on the loop).
        self.lookup_latency = data.lookup_latency
        self._handlers: dict[type, Handler] = {
            p.Ping: lambda session, msg: p.Pong(),
            p.Events: lambda session, msg: self.residency.read(msg),
            **data.handlers(),
            **management.handlers(),
        }

    def _follow_tiers(self) -> None:
        """Hook every tier's removals and arrivals into the eviction record and the residency log
        (called under the tiers' own locks: each records under a private lock, never calling a tier)."""
        for tier in self.engine.tiers:
            tier.stats.listener = chain_removals(
                self.evictions.listener(tier.name), self.residency.removed(tier.name)
            )
            tier.stats.arrival = self.residency.stored(tier.name)

    def _request_ops(self) -> tuple[DataOps, ManagementOps]:
        """The data-path and management handlers, sharing one layout registry (explain resolves
        the groups that the data path registered)."""
        engine = self.engine
        layouts = Layouts(engine, self.options)
        data = DataOps(
            engine,
            self._l1,
            self.options,
            self._sessions,
            layouts,
            self._offload,
            lambda: self._received,
            self.tenant_lookups,
            self._complete,
        )
        management = ManagementOps(
            engine, layouts, self.evictions, self._offload, self._server_stats, self.tenant_lookups
        )
        return data, management

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def arena(self) -> SharedArena:
        """The L1 arena workers attach to (this process's mapping)."""
        return self._l1.arena

    @property
    def endpoint(self) -> str:
        """The endpoint clients connect to (for ``tcp://host:0`` the port actually bound)."""
        if self._sock is not None:
            last = self._sock.getsockopt(zmq.LAST_ENDPOINT)
            if isinstance(last, bytes) and last:
                return last.decode()
        return self.options.listen

    def start(self) -> None:
        """Bind the socket (errors raise here, in the caller) and start the request loop thread."""
        with self._lifecycle:
            if self._started:
                return
            raise_descriptor_limit()
            map_large_buffers()  # a peer's frames, once freed, leave nothing resident
            self._bind()
            self._started = True
            self._thread = threading.Thread(target=self._run, name="tiercache-server-loop", daemon=True)
            self._thread.start()
            log.info("tiercache server listening on %s (arena %s)", self.endpoint, self._l1.arena_name)

    def serve_forever(self) -> None:
        """Start if needed and block until :meth:`stop` finished. Signal handlers keep running.
        Raises :class:`~tiercache.errors.ServerError` if the request loop failed (it then stopped
        the server itself): the process should exit non-zero and be restarted."""
        self.start()
        while not self._stopped.wait(0.2):  # short waits so the main thread can run signal handlers
            pass
        if self.failure is not None:
            raise ServerError(
                f"the request loop failed ({type(self.failure).__name__}: {self.failure}); the server stopped. "
                "This is a bug: please report it with the log above; restart the server"
            ) from self.failure

    def stop(self, timeout: float | None = None) -> bool:
        """Stop accepting, drain in-flight work, flush and close the engine. Idempotent.

        Blocks up to about ``timeout`` seconds (default ``options.drain_timeout_s``) for in-flight
        requests and again for the engine's flush; returns ``False`` if something was cut short.
        """
        timeout = self.options.drain_timeout_s if timeout is None else timeout
        with self._lifecycle:
            first = not self._stop_requested.is_set()
            self._stop_requested.set()
            self._wake()
            thread = self._thread
        clean = True
        if thread is not None:
            thread.join(timeout + 1.0)
            clean = not thread.is_alive()
        if first:
            self._executor.shutdown(wait=True, cancel_futures=True)
            clean = self.engine.flush(timeout) and clean
            self.engine.close(timeout)
            if self._auth is not None:
                self._auth.stop()
            if self._ctx is not None:
                self._ctx.term()
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._stopped.set()
        return clean

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _bind(self) -> None:
        opts = self.options
        if opts.listen.startswith(UNIX_SCHEME):
            path = prepare_socket(opts.listen)
            self._poller = EpollPoller()
            self._unix = UnixListener(path, self._poller, self._sessions.drop)
            return
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.linger = 0
        # A larger frame closes its connection before libzmq buffers it: no frame from anyone,
        # a stranger included, costs the server more than this (larger requests come in parts).
        sock.setsockopt(zmq.MAXMSGSIZE, REQUEST_FRAME_BYTES)
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        # No ROUTER_HANDOVER: a second connection with a routing id already connected is turned
        # away, so copying a client's id (it travels in the clear without CURVE) cannot take over
        # its connection. A client whose connection died reconnects once the server sees it gone
        # (at once on ipc; on tcp by the ZMTP heartbeats below) or comes back with a new id.
        if opts.listen.startswith("tcp://"):
            sock.setsockopt(zmq.HEARTBEAT_IVL, _ZMTP_HEARTBEAT_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _ZMTP_HEARTBEAT_MS * 3)
            # A connection that has not finished its ZMTP (and CURVE) handshake within this is
            # closed: a silent connect holds a descriptor for seconds, not the default 30 s.
            sock.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_MS)
        try:
            if opts.listen.startswith("tcp://"):
                self._auth = setup_curve(ctx, sock, opts)
                sock.bind(opts.listen)
            else:
                path = prepare_socket(opts.listen)
                sock.bind(opts.listen)
                secure_socket(path)
        except zmq.ZMQError as exc:
            sock.close(0)
            ctx.term()
            raise ServerError(f"cannot listen on {opts.listen}: {exc}; is another server using it?") from exc
        except BaseException:
            sock.close(0)
            if self._auth is not None:
                self._auth.stop()
            ctx.term()
            raise
        self._ctx, self._sock = ctx, sock

    # -- the loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        sock, unix = self._sock, self._unix
        assert sock is not None or unix is not None
        poller = self._poller
        if sock is not None:
            assert isinstance(poller, zmq.Poller)
            poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, _POLLIN)
        sweep_every = min(1.0, self.options.heartbeat_timeout_s / 4)
        next_sweep = time.monotonic() + sweep_every
        drain_end: float | None = None
        try:
            while True:
                if self._stop_requested.is_set():
                    if drain_end is None:
                        drain_end = time.monotonic() + self.options.drain_timeout_s
                    if self._inflight == 0 or time.monotonic() > drain_end:
                        break
                wait_ms = 100 if drain_end is not None else int(sweep_every * 1000)
                events = dict(poller.poll(0 if unix is not None and unix.backlog else wait_ms))
                if sock is not None and sock in events:
                    self._read_requests(sock)
                if unix is not None:
                    self._serve_unix(unix, events)
                if self._wake_r in events:
                    self._drain_wakeups()
                self._send_completions()
                now = time.monotonic()
                if now >= next_sweep:
                    self._sessions.expire(now)
                    next_sweep = now + sweep_every
        except BaseException as exc:  # a bug here must not leave the arena leaked: release below, then report
            self.failure = exc
            log.critical(
                "the tiercache server's request loop failed (%s: %s); the server stops and exits non-zero so "
                "that a supervisor restarts it",
                type(exc).__name__,
                exc,
                exc_info=True,
            )
            # Nobody would be answered any more: stop (drain, flush, close) as a signal would.
            threading.Thread(target=self.stop, name="tiercache-shutdown", daemon=True).start()
        finally:
            self._sessions.close_all()
            if sock is not None:
                sock.close(0)
                self._sock = None
            if unix is not None:
                unix.close_all()
            if isinstance(poller, EpollPoller):
                poller.close()

    def _read_requests(self, sock: zmq.Socket[bytes]) -> None:
        for _ in range(256):  # bounded batch so completions are not starved by a flood
            # Asked, not tried: a recv that finds nothing raises, and an exception per loop turn
            # was a measurable share of a small request's CPU.
            if not cast(int, sock.getsockopt(zmq.EVENTS)) & _POLLIN:  # EVENTS is an int option
                return
            try:
                # The routing id as a frame: it carries the peer's address, which a failed hello names.
                head = sock.recv(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = head.bytes
            known = identity in self._sessions.by_identity
            # The body, up to max_message_bytes, and its trailer (a tag).
            limit = self.options.max_message_bytes + TAG_BYTES if known else _HANDSHAKE_MESSAGE_BYTES
            parts: list[zmq.Frame] = []
            size = 0
            more = head.more  # (a frame's own flag: no getsockopt call per part)
            while more:
                part = sock.recv(copy=False)  # at most REQUEST_FRAME_BYTES (MAXMSGSIZE)
                more = part.more
                size += len(part)
                if size <= limit:
                    parts.append(part)
                elif parts:
                    parts.clear()  # over the bound: each further part is freed as it is read
            if size == 0 and not parts:
                continue
            if size > limit:
                self._counters["requests"] += 1
                self._send(identity, self._oversized(known, size), False)
                continue
            body, tag = request_of([part.buffer for part in parts])
            reply, signed = self._handle(identity, body, tag, partial(peer_of, head))
            if reply is not None:
                self._send(identity, reply, signed)

    def _serve_unix(self, unix: UnixListener, events: dict[Any, int]) -> None:
        """Accept, read and answer on the ``unix://`` connections ``events`` names (and those with
        whole messages left from the last turn); send the replies their sockets now take."""
        if unix.fileno() in events:
            unix.accept()
        by_fd = unix.by_fd
        ready = [by_fd[key] for key in events if key in by_fd]
        ready.extend(conn for conn in unix.backlog if conn not in ready)
        sessions = self._sessions.by_identity
        handshake = _HANDSHAKE_MESSAGE_BYTES
        most = self.options.max_message_bytes + TAG_BYTES

        def limit(identity: bytes) -> int:
            return most if identity in sessions else handshake

        for conn in ready:
            if conn.writing and events.get(conn.fileno(), 0) & _POLLOUT:
                unix.flush(conn)
            if not (events.get(conn.fileno(), 0) & _POLLIN or conn in unix.backlog):
                continue
            peer = partial(str, conn.peer)
            for item in unix.read(conn, limit):
                if isinstance(item, Message):
                    reply, signed = self._handle(conn.identity, item.body, item.tag, peer)
                    if reply is not None:
                        self._send(conn.identity, reply, signed)
                    continue
                # Larger than its sender may send: refused unread, and its connection closed.
                self._counters["requests"] += 1
                self._send(conn.identity, self._oversized(conn.identity in sessions, item.size), False)
                unix.close(conn)
                break

    def _oversized(self, known: bool, size: int) -> p.ErrorReply:
        """The refusal of a message larger than its sender may send: ``max_message_bytes`` for a
        session, a handshake's for a peer without one (dropped unread: never joined, never
        decoded, where msgpack would expand ~9x into objects)."""
        if known:
            return p.ErrorReply(
                code=p.ErrorCode.TOO_LARGE,
                message=f"message of {size} bytes exceeds the server's max_message_bytes "
                f"{self.options.max_message_bytes}; store large chunks through the arena",
            )
        self._counters["stranger_frames"] += 1
        return p.ErrorReply(
            code=p.ErrorCode.HELLO_REQUIRED,
            message=f"a connection without a session may send only a challenge or a hello (at most "
            f"{_HANDSHAKE_MESSAGE_BYTES} bytes); a message of {size} bytes was dropped unread",
        )

    def _send(self, identity: bytes, reply: p.Message, signed: bool = True) -> None:
        """Send ``reply``; on a shared-secret session (and ``signed``) with its tag frame. Replies to
        requests that did not prove the session are never signed: the client does not believe them,
        save the errors that tell it to say hello again."""
        if isinstance(reply, p.ErrorReply):
            self._counters["errors"] += 1
        body = self._codec.encode(reply)
        session = self._sessions.get(identity) if signed else None
        tag = None if session is None or session.seal is None else session.seal.seal(body)
        if self._unix is not None and identity.startswith(IDENTITY_PREFIX):
            if self._unix.send(identity, body, tag):
                self._counters["replies"] += 1
            return
        sock = self._sock
        if sock is None:
            return
        try:
            # Frame by frame: send_multipart's checks of each part cost more than the sends.
            sock.send(identity, _NOBLOCK_MORE)
            if tag is None:
                sock.send(body, _NOBLOCK)
            else:
                sock.send(body, _NOBLOCK_MORE)
                sock.send(tag, _NOBLOCK)
            self._counters["replies"] += 1
        except zmq.Again:
            log.debug("reply to a client dropped: its queue is full")
        except zmq.ZMQError as exc:
            log.debug("reply to a client dropped: %s", exc)

    def _handle(
        self, identity: bytes, frame: bytes, tag: bytes | None, peer: Callable[[], str] = lambda: "unknown"
    ) -> tuple[p.Message | None, bool]:
        """Decode and dispatch one request; every failure becomes an error reply. Also says whether
        the reply may be signed: only when the request proved the session (or opened it). ``peer``
        names the sender's address (asked only of a hello)."""
        self._received = time.perf_counter()
        self._counters["requests"] += 1
        now = time.monotonic()
        if len(frame) > self.options.max_message_bytes:  # the body alone: a trailer may have fit
            return self._oversized(True, len(frame)), False
        try:
            msg = self._codec.requests.decode(frame)
        except Exception:  # undecodable in any way (a frame nested past the decoder's depth too)
            self._counters["malformed"] += 1
            req_id, code, message = self._codec.classify_bad_request(frame)
            return p.ErrorReply(req_id=req_id, code=code, message=message), False
        signed = False
        try:
            if self._stop_requested.is_set():
                raise Refused(
                    p.ErrorCode.SHUTTING_DOWN, "the server is shutting down; retry on its successor"
                )
            if isinstance(msg, p.Challenge):
                reply: p.Message | None = self._sessions.challenge(identity)
            elif isinstance(msg, p.Hello):
                reply = self._hello(identity, msg, now, peer())
                signed = True  # with the key this hello just proved: the client checks the server
            else:
                session = self._sessions.get(identity)
                if session is None:
                    raise Refused(
                        p.ErrorCode.HELLO_REQUIRED,
                        "send hello first (new connection, or the server restarted)",
                    )
                if not self._sessions.verify(session, frame, tag):
                    raise Refused(
                        p.ErrorCode.AUTH_FAILED,
                        "this request does not carry its session's signature (signed by another "
                        "session, replayed, or sent by a client of another tiercache version); the "
                        "session is untouched: say hello again with the shared secret",
                    )
                session.last_seen = now
                signed = True
                keys = request_keys(msg)
                if keys > self.options.max_keys_per_request:
                    raise Refused(
                        p.ErrorCode.INVALID,
                        f"this request names {keys} keys, over the server's --max-keys-per-request "
                        f"{self.options.max_keys_per_request}; split it",
                    )
                reply = self._handlers[type(msg)](session, msg)
        except Refused as exc:
            return p.ErrorReply(req_id=msg.req_id, code=exc.code, message=exc.message), signed
        except Exception as exc:  # never crash the loop on client input
            return error_reply(msg.req_id, exc), signed
        if reply is not None:
            reply.req_id = msg.req_id
        return reply, signed

    def _hello(self, identity: bytes, msg: p.Hello, now: float, peer: str) -> p.Message:
        """A hello, unless its peer has failed too often of late (:mod:`tiercache.server.hellos`)."""
        if not self.options.auth_secret:
            return self._sessions.hello(identity, msg, now)
        wait = self._hellos.wait_s(peer)
        if wait:
            raise Refused(
                p.ErrorCode.AUTH_FAILED,
                f"too many failed hellos from {peer} of late; the next one is checked in {wait:.1f} s: "
                "give the client the server's shared secret",
            )
        try:
            reply = self._sessions.hello(identity, msg, now)
        except Refused as exc:
            if exc.code == p.ErrorCode.AUTH_FAILED:
                self._hellos.failure(peer, msg.client_name)
            raise
        self._hellos.success(peer)
        return reply

    # -- offloading to the I/O executor ----------------------------------------------------------
    def _offload(
        self,
        session: Session,
        req_id: int,
        job: Callable[[], Any],
        finish: Callable[[Any], p.Message | None],
        sent: Callable[[p.Message | None], None] | None = None,
    ) -> None:
        """Run ``job`` on the I/O executor; ``finish(result)`` then runs on the loop and its reply
        is sent, then ``sent(reply)`` is called. Raises ``busy`` when the executor already has its
        bound of jobs."""
        if self._inflight >= self._max_inflight:
            raise Refused(p.ErrorCode.BUSY, f"{self._inflight} requests in flight; retry shortly")
        self._inflight += 1
        identity = session.identity

        def done(fut: Future[Any]) -> None:
            self._completed.append(_Completion(identity, req_id, fut, finish, sent))
            self._wake()

        self._executor.submit(job).add_done_callback(done)

    def _complete(
        self,
        session: Session,
        req_id: int,
        result: Any,
        finish: Callable[[Any], p.Message | None],
        sent: Callable[[p.Message | None], None] | None = None,
    ) -> None:
        """Queue a result computed on the loop (no I/O was needed) as an executor job's would be:
        :meth:`_send_completions`, later in this loop iteration, finishes and sends it."""
        self._inflight += 1
        self._completed.append(_Completion(session.identity, req_id, None, finish, sent, result))

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # pipe full (the loop is already due to wake) or closed at shutdown

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _send_completions(self) -> None:
        completed = self._completed
        while completed:  # the loop is the only consumer: a non-empty deque stays so until it pops
            c = completed.popleft()
            self._inflight -= 1
            try:
                reply = c.finish(c.result if c.future is None else c.future.result())
            except Exception as exc:
                reply = error_reply(c.req_id, exc)
            if reply is not None:
                reply.req_id = c.req_id
                self._send(c.identity, reply)
            if c.sent is not None:
                c.sent(reply)

    # -- observation -----------------------------------------------------------------------------
    def _server_stats(self) -> dict[str, int]:
        """The server's own counters for the ``stats`` reply. Request loop."""
        return {
            **self._counters,
            "clients_expired": self._sessions.expired,
            "clients_disconnected": self._sessions.disconnected,
            "refused_unsigned": self._sessions.refused_unsigned,
            "hellos_failed": self._hellos.failed,
            "hellos_held": self._hellos.held,
            "leases_lost": self._sessions.lost_leases,
            **self._sessions.counts(),
            "in_flight": self._inflight,
            "eviction_records": len(self.evictions),
            # unix:// only: connections closed at once, opened by a process of another user.
            # And those closed for speaking ZeroMQ (clients given ipc:// for this socket).
            **(
                {"connections_refused": self._unix.refused, "zmq_connections_closed": self._unix.zmq_peers}
                if self._unix is not None
                else {}
            ),
        }

    def metrics_stats(self) -> dict[str, Any]:
        """What ``/metrics`` exports: :meth:`TieredEngine.stats` plus latency histograms (lookups by
        outcome, per-tier transfers). Thread-safe: called on the metrics server's thread."""
        stats = with_tenants(
            self.engine.stats(), self.tenant_lookups, self.options.metrics_tenants, self._metric_tenants
        )
        return {
            **stats,
            "latency": {"lookup": self.lookup_latency.snapshot(), "tiers": self.engine.latency()},
        }
