"""The tiercache server: one per node, owning the engine and speaking :mod:`tiercache.protocol`.

Threads:

* ``tiercache-server-loop`` — the request loop. Owns the ROUTER socket and every piece of per-client
  state (no lock needed: only this thread touches it). Does only in-memory work: decoding, L1
  reservations/pins/commits (L1 never blocks on I/O), bookkeeping.
* ``tiercache-server-io-N`` — a bounded executor (``io_workers``) for anything that may touch L2/L3:
  lookups, promotions, gets, stats, listing, explain, clear, warm, manifest registration. A finished job
  puts its result on a queue and writes one byte to a wake-up pipe that the loop polls beside the
  socket; the loop then builds and sends the reply. Jobs never touch per-client state.

Lifecycle like uvicorn's: :meth:`Server.start` binds and starts the loop; :meth:`Server.serve_forever`
blocks until :meth:`Server.stop`, which stops accepting requests, drains in-flight jobs, releases every
client's reservations and leases, flushes the engine and closes the tiers. No signal handling and no
``sys.exit`` here: the CLI owns both.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import msgspec
import zmq

from tiercache import __version__ as SERVER_VERSION
from tiercache import protocol as p
from tiercache.config import ServerOptions
from tiercache.engine import (
    GroupSpec,
    PrefetchTicket,
    TicketState,
    TieredEngine,
    needed_keys,
)
from tiercache.errors import (
    ConfigError,
    KeyFormatError,
    LeaseError,
    ReservationError,
    ServerError,
    TierCacheError,
    TierFullError,
)
from tiercache.keys.fingerprint import Fingerprint, GroupKind, LayoutManifest
from tiercache.keys.hashing import HASH_BYTES
from tiercache.keys.object_key import ObjectKey
from tiercache.l1 import L1Tier
from tiercache.latency import LatencySet
from tiercache.server import security
from tiercache.server.records import EvictionRecord
from tiercache.tier import ReadHandle, WriteHandle

log = logging.getLogger(__name__)

#: In-flight executor jobs allowed per I/O worker before new ones get ``busy`` (bounds memory and
#: queueing delay; a scheduler would rather recompute than wait behind a deep queue).
_JOBS_PER_WORKER = 64
#: Challenges handed out but not yet used (a stranger cannot grow this without bound).
_MAX_PENDING_NONCES = 4096
#: Largest page a list_keys request may ask for.
_MAX_PAGE = 10_000
#: Frames above max_message_bytes but below this multiple get an error reply; above it libzmq drops
#: the connection before the bytes are buffered (``MAXMSGSIZE``), so a huge frame cannot exhaust memory.
_HARD_LIMIT_FACTOR = 2


class _Refused(Exception):
    """A request the server answers with an error reply (never escapes the loop)."""

    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True, eq=False)
class _Client:
    """What one connected client (ROUTER identity) holds. Touched only by the loop thread."""

    identity: bytes
    name: str
    last_seen: float
    reservations: dict[int, WriteHandle] = field(default_factory=dict)
    leases: dict[int, ReadHandle] = field(default_factory=dict)
    tickets: dict[int, PrefetchTicket] = field(default_factory=dict)


@dataclass(slots=True)
class _Completion:
    identity: bytes
    req_id: int
    future: Future[Any]
    finish: Callable[[Any], p._Msg | None]
    #: Called on the loop with the reply just sent (``None``: nothing was sent), e.g. to time it.
    sent: Callable[[p._Msg | None], None] | None = None


#: Outcomes a lookup's latency is recorded under (``tiercache_lookup_duration_seconds{outcome}``).
LOOKUP_OUTCOMES = ("hit", "miss", "error")


class Server:
    """Serve ``engine`` on ``options.listen``. See the module docstring for threads and lifecycle.

    The server takes ownership of ``engine``: :meth:`stop` flushes and closes it.
    """

    def __init__(self, engine: TieredEngine, options: ServerOptions | None = None) -> None:
        if not isinstance(engine.l1, L1Tier):
            raise ConfigError(
                "the server needs an L1Tier (a shared arena) as the engine's first tier; build the engine with "
                "ServerConfig.build_engine() or pass L1Tier first"
            )
        self.engine = engine
        self.options = options or ServerOptions()
        self._l1: L1Tier = engine.l1
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._auth: Any = None
        self._thread: threading.Thread | None = None
        self._executor = ThreadPoolExecutor(self.options.io_workers, thread_name_prefix="tiercache-server-io")
        self._max_inflight = self.options.io_workers * _JOBS_PER_WORKER
        self._completed: queue.SimpleQueue[_Completion] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self._stop_requested = threading.Event()
        self._stopped = threading.Event()
        self._lifecycle = threading.Lock()  # guards start/stop transitions
        self._started = False
        # Loop-thread state (no lock: only the loop thread reads or writes it).
        self._codec = p.Codec()
        self._clients: dict[bytes, _Client] = {}
        self._nonces: OrderedDict[bytes, bytes] = OrderedDict()
        self._owner: dict[int, bytes] = {}  # reservation/lease token -> client identity
        self._ticket_owner: dict[int, bytes] = {}
        self._inflight = 0
        self._counters: dict[str, int] = {"requests": 0, "errors": 0, "clients_expired": 0}
        self._received = 0.0  # perf_counter() when the request being handled arrived
        #: Seconds from a lookup's arrival to its reply's send, by outcome (observed on the loop).
        self.lookup_latency = LatencySet(LOOKUP_OUTCOMES)
        # Registered groups: read by I/O jobs (lookup/explain), written by the loop.
        self._specs_lock = threading.Lock()
        self._specs: dict[tuple[bytes, int], GroupSpec] = {}  # guarded by _specs_lock
        self.evictions = EvictionRecord()
        for tier in engine.tiers:
            tier.stats.listener = self.evictions.listener(tier.name)
        self._handlers: dict[type, Callable[[_Client, Any], p._Msg | None]] = {
            p.Ping: self._on_ping,
            p.RegisterEngine: self._on_register,
            p.Lookup: self._on_lookup,
            p.PollTicket: self._on_poll_ticket,
            p.ReleaseTicket: self._on_release_ticket,
            p.Reserve: self._on_reserve,
            p.Commit: self._on_commit,
            p.Abort: self._on_abort,
            p.Pin: self._on_pin,
            p.Release: self._on_release,
            p.Put: self._on_put,
            p.Get: self._on_get,
            p.Delete: self._on_delete,
            p.Stats: self._on_stats,
            p.ListKeys: self._on_list_keys,
            p.GetManifest: self._on_manifest,
            p.Explain: self._on_explain,
            p.Clear: self._on_clear,
            p.ClearBatch: self._on_clear_batch,
            p.Warm: self._on_warm,
        }

    # -- lifecycle -------------------------------------------------------------------------------
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
            self._bind()
            self._started = True
            self._thread = threading.Thread(target=self._run, name="tiercache-server-loop", daemon=True)
            self._thread.start()
            log.info("tiercache server listening on %s (arena %s)", self.endpoint, self._l1.arena_name)

    def serve_forever(self) -> None:
        """Start if needed and block until :meth:`stop` finished. Signal handlers keep running."""
        self.start()
        while not self._stopped.wait(0.2):  # short waits so the main thread can run signal handlers
            pass

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
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.setsockopt(zmq.MAXMSGSIZE, opts.max_message_bytes * _HARD_LIMIT_FACTOR + 4096)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client with the same id takes over
        try:
            if opts.listen.startswith("tcp://"):
                self._auth = security.setup_curve(ctx, sock, opts)
                sock.bind(opts.listen)
            else:
                path = security.ipc_path(opts.listen)
                security.prepare_ipc(path)
                sock.bind(opts.listen)
                security.secure_ipc(path)
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
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
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
                events = dict(poller.poll(100 if drain_end is not None else int(sweep_every * 1000)))
                if sock in events:
                    self._read_requests(sock)
                if self._wake_r in events:
                    self._drain_wakeups()
                self._send_completions(sock)
                now = time.monotonic()
                if now >= next_sweep:
                    self._expire_clients(now)
                    next_sweep = now + sweep_every
        except Exception:  # a bug here must not leave the arena leaked: release below, then report
            log.exception("tiercache server loop failed")
        finally:
            for client in list(self._clients.values()):
                self._release_client(client)
            self._clients.clear()
            sock.close(0)
            self._sock = None

    def _read_requests(self, sock: zmq.Socket[bytes]) -> None:
        for _ in range(256):  # bounded batch so completions are not starved by a flood
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            identity = frames[0]
            reply = self._handle(identity, frames[1:])
            if reply is not None:
                self._send(sock, identity, reply)

    def _send(self, sock: zmq.Socket[bytes], identity: bytes, reply: p._Msg) -> None:
        if isinstance(reply, p.ErrorReply):
            self._counters["errors"] += 1
        try:
            sock.send_multipart([identity, self._codec.encode(reply)], zmq.NOBLOCK)
        except zmq.Again:
            log.debug("reply to a client dropped: its queue is full")
        except zmq.ZMQError as exc:
            log.debug("reply to a client dropped: %s", exc)

    def _handle(self, identity: bytes, frames: list[bytes]) -> p._Msg | None:
        """Decode and dispatch one request; every failure becomes an error reply."""
        self._received = time.perf_counter()
        self._counters["requests"] += 1
        now = time.monotonic()
        client = self._clients.get(identity)
        if client is not None:
            client.last_seen = now
        frame = frames[0]
        if len(frames) != 1:
            return p.ErrorReply(code=p.ErrorCode.MALFORMED, message=f"a request is one frame, got {len(frames)}")
        if len(frame) > self.options.max_message_bytes:
            return p.ErrorReply(
                code=p.ErrorCode.TOO_LARGE,
                message=f"message of {len(frame)} bytes exceeds the server's max_message_bytes "
                f"{self.options.max_message_bytes}; store large chunks through the arena",
            )
        try:
            msg = self._codec.requests.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            req_id, code, message = self._codec.classify_bad_request(frame)
            return p.ErrorReply(req_id=req_id, code=code, message=message)
        try:
            if self._stop_requested.is_set():
                raise _Refused(p.ErrorCode.SHUTTING_DOWN, "the server is shutting down; retry on its successor")
            if isinstance(msg, p.Challenge):
                reply: p._Msg | None = self._on_challenge(identity, msg)
            elif isinstance(msg, p.Hello):
                reply = self._on_hello(identity, msg, now)
            elif client is None:
                raise _Refused(
                    p.ErrorCode.HELLO_REQUIRED,
                    "send hello first (new connection, or the server restarted)",
                )
            else:
                reply = self._handlers[type(msg)](client, msg)
        except _Refused as exc:
            return p.ErrorReply(req_id=msg.req_id, code=exc.code, message=exc.message)
        except Exception as exc:  # never crash the loop on client input
            return self._error_for(msg.req_id, exc)
        if reply is not None:
            reply.req_id = msg.req_id
        return reply

    def _error_for(self, req_id: int, exc: BaseException) -> p.ErrorReply:
        if isinstance(exc, _Refused):
            code, message = exc.code, exc.message
        elif isinstance(exc, TierFullError):
            code, message = p.ErrorCode.TIER_FULL, str(exc)
        elif isinstance(exc, (ReservationError, LeaseError)):
            code, message = p.ErrorCode.UNKNOWN_TOKEN, str(exc)
        elif isinstance(exc, (KeyFormatError, ConfigError, ValueError)):
            code, message = p.ErrorCode.INVALID, str(exc)
        elif isinstance(exc, TierCacheError):
            code, message = p.ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"
        else:
            log.exception("request %d failed", req_id, exc_info=exc)
            code, message = p.ErrorCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"
        return p.ErrorReply(req_id=req_id, code=code, message=message)

    # -- offloading to the I/O executor ----------------------------------------------------------
    def _offload(
        self,
        client: _Client,
        req_id: int,
        job: Callable[[], Any],
        finish: Callable[[Any], p._Msg | None],
        sent: Callable[[p._Msg | None], None] | None = None,
    ) -> None:
        """Run ``job`` on the I/O executor; ``finish(result)`` then runs on the loop and its reply
        is sent, then ``sent(reply)`` is called. Raises ``busy`` when the executor already has its
        bound of jobs."""
        if self._inflight >= self._max_inflight:
            raise _Refused(p.ErrorCode.BUSY, f"{self._inflight} requests in flight; retry shortly")
        self._inflight += 1
        identity = client.identity

        def done(fut: Future[Any]) -> None:
            self._completed.put(_Completion(identity, req_id, fut, finish, sent))
            self._wake()

        self._executor.submit(job).add_done_callback(done)

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

    def _send_completions(self, sock: zmq.Socket[bytes]) -> None:
        while True:
            try:
                c = self._completed.get_nowait()
            except queue.Empty:
                return
            self._inflight -= 1
            try:
                reply = c.finish(c.future.result())
            except Exception as exc:
                reply = self._error_for(c.req_id, exc)
            if reply is not None:
                reply.req_id = c.req_id
                self._send(sock, c.identity, reply)
            if c.sent is not None:
                c.sent(reply)

    # -- clients and heartbeats ------------------------------------------------------------------
    def _expire_clients(self, now: float) -> None:
        limit = self.options.heartbeat_timeout_s
        for client in [c for c in self._clients.values() if now - c.last_seen > limit]:
            log.info("client %r silent for %.1f s; releasing its reservations and leases", client.name, now - client.last_seen)
            self._release_client(client)
            del self._clients[client.identity]
            self._counters["clients_expired"] += 1

    def _release_client(self, client: _Client) -> None:
        for token, handle in client.reservations.items():
            self._owner.pop(token, None)
            self.engine.abort(handle)
        if client.leases:
            for token in client.leases:
                self._owner.pop(token, None)
            self._l1.release_many(list(client.leases.values()))
        for ticket_id, ticket in client.tickets.items():
            self._ticket_owner.pop(ticket_id, None)
            self.engine.release_ticket(ticket)
        client.reservations.clear()
        client.leases.clear()
        client.tickets.clear()

    def _claim(self, client: _Client, tokens: list[int], table: str) -> list[Any]:
        """The handles behind ``tokens`` if all are this client's (checked before acting on any)."""
        handles = []
        own: dict[int, Any] = getattr(client, table)
        kind = "reservation" if table == "reservations" else "lease"
        for token in tokens:
            handle = own.get(token)
            if handle is None:
                if token in self._owner:
                    raise _Refused(p.ErrorCode.NOT_OWNER, f"{kind} {token} belongs to another client")
                raise _Refused(
                    p.ErrorCode.UNKNOWN_TOKEN,
                    f"no open {kind} {token}: never issued, already finished, or released when this "
                    "client missed its heartbeats",
                )
            handles.append(handle)
        return handles

    def _ticket(self, client: _Client, ticket_id: int) -> PrefetchTicket:
        ticket = client.tickets.get(ticket_id)
        if ticket is None:
            if ticket_id in self._ticket_owner:
                raise _Refused(p.ErrorCode.NOT_OWNER, f"ticket {ticket_id} belongs to another client")
            raise _Refused(p.ErrorCode.UNKNOWN_TOKEN, f"no open ticket {ticket_id}; look up again")
        return ticket

    # -- handshake -------------------------------------------------------------------------------
    def _on_challenge(self, identity: bytes, msg: p.Challenge) -> p._Msg:
        nonce = secrets.token_bytes(32)
        self._nonces[identity] = nonce
        self._nonces.move_to_end(identity)
        while len(self._nonces) > _MAX_PENDING_NONCES:
            self._nonces.popitem(last=False)
        return p.ChallengeReply(req_id=msg.req_id, nonce=nonce)

    def _on_hello(self, identity: bytes, msg: p.Hello, now: float) -> p._Msg:
        if msg.protocol_version != p.PROTOCOL_VERSION:
            raise _Refused(
                p.ErrorCode.VERSION_MISMATCH,
                f"client speaks protocol {msg.protocol_version}, this server {p.PROTOCOL_VERSION} "
                f"(tiercache {SERVER_VERSION}); install matching tiercache versions",
            )
        secret = self.options.auth_secret
        if secret:
            nonce = self._nonces.pop(identity, None)
            if nonce is None or not security.check_proof(secret, nonce, msg.auth):
                raise _Refused(
                    p.ErrorCode.AUTH_FAILED,
                    "this server requires the shared secret: give the client the same auth secret "
                    "as the server (--auth-secret / TIERCACHE_AUTH_SECRET)",
                )
        client = self._clients.get(identity)
        if client is None:
            self._clients[identity] = _Client(identity, msg.client_name[:128], now)
        else:
            client.last_seen = now
        opts = self.options
        return p.HelloReply(
            protocol_version=p.PROTOCOL_VERSION,
            server_version=SERVER_VERSION,
            chunk_size=opts.chunk_size,
            separate_object_groups=opts.separate_object_groups,
            arena_name=self._l1.arena_name,
            arena_size=self._l1.arena.size,
            heartbeat_timeout_s=opts.heartbeat_timeout_s,
            max_message_bytes=opts.max_message_bytes,
        )

    def _on_ping(self, client: _Client, msg: p.Ping) -> p._Msg:
        return p.Pong()

    # -- registration ----------------------------------------------------------------------------
    def _on_register(self, client: _Client, msg: p.RegisterEngine) -> None:
        opts = self.options
        if not msg.groups:
            raise _Refused(p.ErrorCode.INVALID, "register needs at least one object group")
        if not opts.separate_object_groups and len(msg.groups) > 1:
            raise _Refused(
                p.ErrorCode.INVALID,
                f"this server runs with --no-separate-object-groups: register one object group "
                f"holding every layer, not {len(msg.groups)}",
            )
        seen: set[int] = set()
        parsed: list[tuple[int, LayoutManifest]] = []
        for g in msg.groups:
            if g.object_group in seen or not 0 <= g.object_group <= 0xFFFF:
                raise _Refused(p.ErrorCode.INVALID, f"object group {g.object_group} is duplicated or out of range")
            seen.add(g.object_group)
            m = LayoutManifest.from_dict(g.manifest)
            if m.chunk_size != opts.chunk_size:
                raise _Refused(
                    p.ErrorCode.INVALID,
                    f"group {g.object_group}: the engine uses chunk size {m.chunk_size} but the server "
                    f"--chunk-size is {opts.chunk_size}; use the server's value (from hello)",
                )
            for what, block in (("manager", m.manager_block_size), ("kernel", m.kernel_block_size)):
                if block <= 0 or opts.chunk_size % block:
                    raise _Refused(
                        p.ErrorCode.INVALID,
                        f"group {g.object_group}: --chunk-size {opts.chunk_size} is not a multiple of "
                        f"the engine's {what} block size {block}; use {block} or a multiple of it",
                    )
            if m.group_kind is GroupKind.SLIDING_WINDOW and not (m.sliding_window or 0) > 0:
                raise _Refused(p.ErrorCode.INVALID, f"group {g.object_group}: a sliding-window group needs sliding_window > 0")
            parsed.append((g.object_group, m))

        def job() -> list[tuple[int, Fingerprint, LayoutManifest]]:
            return [(group, self.engine.register_manifest(m), m) for group, m in parsed]

        def finish(done: list[tuple[int, Fingerprint, LayoutManifest]]) -> p._Msg:
            refs = []
            with self._specs_lock:
                for group, fp, m in done:
                    self._specs[(fp.raw, group)] = self._spec(fp, group, m)
                    refs.append(p.GroupRef(fp.raw, group))
            return p.RegisterReply(groups=refs)

        self._offload(client, msg.req_id, job, finish)

    def _spec(self, fp: Fingerprint, group: int, m: LayoutManifest) -> GroupSpec:
        if m.group_kind is GroupKind.SLIDING_WINDOW:
            return GroupSpec.sliding(group, fp, m.sliding_window or 1, self.options.chunk_size)
        return GroupSpec(group, m.group_kind, fp)

    def _resolve(self, refs: list[p.GroupRef]) -> list[GroupSpec]:
        """Group specs for ``refs``; runs on the executor (may read a manifest from L2/L3)."""
        specs = []
        for ref in refs:
            with self._specs_lock:
                spec = self._specs.get((ref.fingerprint, ref.object_group))
            if spec is None:
                fp = Fingerprint(ref.fingerprint)
                m = self.engine.manifest(fp)
                if m is None:
                    raise _Refused(
                        p.ErrorCode.UNKNOWN_FINGERPRINT,
                        f"fingerprint {fp.hex} was never registered here; send register first",
                    )
                spec = self._spec(fp, ref.object_group, m)
                with self._specs_lock:
                    self._specs[(ref.fingerprint, ref.object_group)] = spec
            specs.append(spec)
        return specs

    @staticmethod
    def _check_hashes(hashes: list[bytes]) -> None:
        for h in hashes:
            if len(h) != HASH_BYTES:
                raise _Refused(p.ErrorCode.INVALID, f"a chunk hash is {HASH_BYTES} bytes, got {len(h)}")

    @staticmethod
    def _key(raw: bytes) -> ObjectKey:
        try:
            return ObjectKey.from_bytes(raw)
        except KeyFormatError as exc:
            raise _Refused(p.ErrorCode.INVALID, str(exc)) from exc

    # -- lookup and promotion --------------------------------------------------------------------
    def _on_lookup(self, client: _Client, msg: p.Lookup) -> None:
        self._check_hashes(msg.hashes)
        if not msg.groups:
            raise _Refused(p.ErrorCode.INVALID, "lookup needs at least one group")
        engine = self.engine

        def job() -> tuple[Any, PrefetchTicket | None]:
            specs = self._resolve(msg.groups)
            found = engine.lookup(msg.hashes, specs)
            ticket = None
            if msg.prefetch and found.chunks > 0:
                target = found.chunks if msg.max_chunks <= 0 else min(found.chunks, msg.max_chunks)
                ticket = engine.prefetch(msg.hashes, specs, target)
                engine.poll(ticket)
            return found, ticket

        identity = client.identity
        received = self._received

        def sent(reply: p._Msg | None) -> None:
            if reply is None:  # the client went away: nothing was answered
                return
            if isinstance(reply, p.LookupReply):
                outcome = "hit" if reply.chunks > 0 else "miss"
            else:
                outcome = "error"
            self.lookup_latency.observe(outcome, time.perf_counter() - received)

        def finish(result: tuple[Any, PrefetchTicket | None]) -> p._Msg | None:
            found, ticket = result
            owner = self._clients.get(identity)
            if ticket is None:
                return p.LookupReply(chunks=found.chunks, per_tier=found.per_tier)
            if owner is None:  # the client went away while we looked
                engine.release_ticket(ticket)
                return None
            owner.tickets[ticket.ticket_id] = ticket
            self._ticket_owner[ticket.ticket_id] = identity
            return self._ticket_reply(ticket, p.LookupReply(chunks=found.chunks, per_tier=found.per_tier))

        self._offload(client, msg.req_id, job, finish, sent)

    def _ticket_reply(self, ticket: PrefetchTicket, reply: p.LookupReply) -> p.LookupReply:
        state = self.engine.poll(ticket)
        reply.ticket = ticket.ticket_id
        reply.state = p.TicketStateName(state.value)
        if state is TicketState.READY:
            reply.ready_chunks = ticket.chunks
            slots = []
            seen: set[ObjectKey] = set()
            for key in needed_keys(ticket.groups, ticket.hashes, ticket.chunks):
                if key in seen:
                    continue
                seen.add(key)
                handle = ticket.handles[key]
                where = self._l1.slot_of(handle)
                slots.append(p.Slot(key.to_bytes(), where.offset, where.nbytes, handle.token))
            reply.slots = slots
        return reply

    def _on_poll_ticket(self, client: _Client, msg: p.PollTicket) -> p._Msg:
        ticket = self._ticket(client, msg.ticket)
        return self._ticket_reply(ticket, p.LookupReply(chunks=ticket.target, per_tier={}))

    def _on_release_ticket(self, client: _Client, msg: p.ReleaseTicket) -> p._Msg:
        ticket = self._ticket(client, msg.ticket)
        del client.tickets[msg.ticket]
        self._ticket_owner.pop(msg.ticket, None)
        self.engine.release_ticket(ticket)
        return p.Done(count=1)

    # -- store path (L1 only: never blocks) -----------------------------------------------------
    def _on_reserve(self, client: _Client, msg: p.Reserve) -> p._Msg:
        items = []
        for raw, nbytes in msg.items:
            if not 0 <= nbytes <= self._l1.arena.size:
                raise _Refused(p.ErrorCode.INVALID, f"cannot reserve {nbytes} bytes in an arena of {self._l1.arena.size}")
            items.append((self._key(raw), nbytes))
        try:
            handles = self._l1.reserve_many(items)
        except TierFullError:
            self.engine.counters.add("stores_dropped", len(items))
            raise
        slots: list[p.Slot | None] = []
        for handle in handles:
            client.reservations[handle.token] = handle
            self._owner[handle.token] = client.identity
            slots.append(self._slot(handle))
        return p.SlotsReply(slots=slots)

    def _on_commit(self, client: _Client, msg: p.Commit) -> p._Msg:
        handles = self._claim(client, msg.tokens, "reservations")
        for handle in handles:
            del client.reservations[handle.token]
            self._owner.pop(handle.token, None)
            self.engine.commit(handle)
        return p.Done(count=len(handles))

    def _on_abort(self, client: _Client, msg: p.Abort) -> p._Msg:
        handles = self._claim(client, msg.tokens, "reservations")
        for handle in handles:
            del client.reservations[handle.token]
            self._owner.pop(handle.token, None)
            self.engine.abort(handle)
        return p.Done(count=len(handles))

    def _on_pin(self, client: _Client, msg: p.Pin) -> p._Msg:
        keys = [self._key(raw) for raw in msg.keys]
        slots: list[p.Slot | None] = []
        t0 = time.perf_counter()
        handles = self._l1.pin_many(keys)
        hits = sum(1 for h in handles if h is not None)
        if hits:  # one lock round trip for all: each hit gets its share, as a "read" of L1
            share = (time.perf_counter() - t0) / hits
            for _ in range(hits):
                self._l1.stats.latency.observe("read", share)
        for handle in handles:
            if handle is None:
                slots.append(None)
                continue
            client.leases[handle.token] = handle
            self._owner[handle.token] = client.identity
            slots.append(self._slot(handle))
        return p.SlotsReply(slots=slots)

    def _slot(self, handle: WriteHandle | ReadHandle) -> p.Slot:
        """Where a reservation's or lease's bytes live in the arena, as the client sees it."""
        where = self._l1.slot_of(handle)
        return p.Slot(handle.key.to_bytes(), where.offset, where.nbytes, handle.token)

    def _on_release(self, client: _Client, msg: p.Release) -> p._Msg:
        handles = self._claim(client, msg.tokens, "leases")
        for handle in handles:
            del client.leases[handle.token]
            self._owner.pop(handle.token, None)
        self._l1.release_many(handles)
        return p.Done(count=len(handles))

    def _on_put(self, client: _Client, msg: p.Put) -> p._Msg:
        return p.Done(count=int(self.engine.put(self._key(msg.key), msg.data)))

    def _on_get(self, client: _Client, msg: p.Get) -> None:
        key = self._key(msg.key)
        limit = self.options.max_message_bytes

        def finish(data: bytes | None) -> p._Msg:
            if data is not None and len(data) > limit - 1024:
                raise _Refused(p.ErrorCode.TOO_LARGE, f"{key} has {len(data)} bytes, over max_message_bytes {limit}; load it through the arena")
            return p.DataReply(data=data)

        self._offload(client, msg.req_id, lambda: self.engine.get(key), finish)

    def _on_delete(self, client: _Client, msg: p.Delete) -> None:
        key = self._key(msg.key)
        self._offload(client, msg.req_id, lambda: self.engine.delete(key), lambda n: p.Done(count=n))

    # -- observation -----------------------------------------------------------------------------
    def metrics_stats(self) -> dict[str, Any]:
        """What ``/metrics`` exports: :meth:`TieredEngine.stats` plus latency histograms (lookups by
        outcome, per-tier transfers). Thread-safe: called on the metrics server's thread."""
        return {
            **self.engine.stats(),
            "latency": {"lookup": self.lookup_latency.snapshot(), "tiers": self.engine.latency()},
        }

    def _on_stats(self, client: _Client, msg: p.Stats) -> None:
        server = {
            **self._counters,
            "clients": len(self._clients),
            "in_flight": self._inflight,
            "reservations": sum(len(c.reservations) for c in self._clients.values()),
            "leases": sum(len(c.leases) for c in self._clients.values()),
            "tickets": len(self._ticket_owner),
            "eviction_records": len(self.evictions),
        }
        self._offload(
            client, msg.req_id, lambda: {**self.engine.stats(), "server": server}, lambda s: p.StatsReply(stats=s)
        )

    def _on_list_keys(self, client: _Client, msg: p.ListKeys) -> None:
        tiers = self._tiers_named(msg.tier)
        limit = max(1, min(msg.limit, _MAX_PAGE))
        if msg.order == "use":
            if not msg.tier:  # use orders are per tier: there is no one order across tiers
                raise _Refused(p.ErrorCode.INVALID, "list_keys order=use lists one tier; name it (tier=...)")
            self._offload(client, msg.req_id, lambda: self._keys_by_use(tiers[0], msg, limit), lambda reply: reply)
            return
        if msg.order != "key":
            raise _Refused(p.ErrorCode.INVALID, f"list_keys order {msg.order!r} is unknown; use 'key' or 'use'")

        def job() -> p._Msg:
            found: dict[bytes, list[str]] = {}
            for tier in tiers:
                for key in tier.iter_keys():
                    if msg.fingerprint and key.fingerprint.raw != msg.fingerprint:
                        continue
                    if msg.object_group >= 0 and key.object_group != msg.object_group:
                        continue
                    raw = key.to_bytes()
                    if raw > msg.cursor:
                        found.setdefault(raw, []).append(tier.name)
            ordered = sorted(found)
            page = ordered[:limit]
            more = len(ordered) > limit
            return p.KeysReply(
                keys=[p.ListedKey(raw, found[raw]) for raw in page],
                next_cursor=page[-1] if more else b"",
            )

        self._offload(client, msg.req_id, job, lambda reply: reply)

    @staticmethod
    def _keys_by_use(tier: Any, msg: p.ListKeys, limit: int) -> p._Msg:
        """A page of ``tier``'s keys, most recently used first; the cursor is how many matching
        keys earlier pages returned (8 bytes, big-endian)."""
        skip = int.from_bytes(msg.cursor, "big") if msg.cursor else 0
        page: list[bytes] = []
        seen = 0
        for key in tier.iter_keys_by_use():
            if msg.fingerprint and key.fingerprint.raw != msg.fingerprint:
                continue
            if msg.object_group >= 0 and key.object_group != msg.object_group:
                continue
            seen += 1
            if seen <= skip:
                continue
            if len(page) == limit:
                return p.KeysReply(keys=[p.ListedKey(k, [tier.name]) for k in page], next_cursor=(skip + limit).to_bytes(8, "big"))
            page.append(key.to_bytes())
        return p.KeysReply(keys=[p.ListedKey(k, [tier.name]) for k in page], next_cursor=b"")

    def _on_manifest(self, client: _Client, msg: p.GetManifest) -> None:
        try:
            fp = Fingerprint(msg.fingerprint)
        except KeyFormatError as exc:
            raise _Refused(p.ErrorCode.INVALID, str(exc)) from exc

        def job() -> p._Msg:
            m = self.engine.manifest(fp)
            return p.ManifestReply(manifest=None if m is None else m.to_dict())

        self._offload(client, msg.req_id, job, lambda reply: reply)

    def _on_explain(self, client: _Client, msg: p.Explain) -> None:
        self._check_hashes(msg.hashes)
        self._offload(client, msg.req_id, lambda: self._explain(msg), lambda reply: reply)

    def _explain(self, msg: p.Explain) -> p._Msg:
        """Per chunk and group: the tier holding it, or why not. Executor; may ask every tier."""
        specs = self._resolve(msg.groups)
        known: set[bytes] = set()
        with self._specs_lock:
            known.update(fp for fp, _ in self._specs)
        for tier in self.engine.lower:
            try:
                known.update(fp.raw for fp, _ in tier.iter_manifests())
            except TierCacheError:
                pass  # a failing tier cannot tell; explain with what the others know
        tiers = self.engine.tiers
        entries = []
        for spec in specs:
            others = [Fingerprint(raw) for raw in sorted(known) if raw != spec.fingerprint.raw]
            for i, h in enumerate(msg.hashes):
                key = spec.key(h)
                holder = next((t.name for t in tiers if t.contains(key)), None)
                if holder is not None:
                    entries.append(p.ExplainEntry(i, spec.object_group, holder))
                    continue
                note = self.evictions.get(key)
                if note is not None:
                    entries.append(
                        p.ExplainEntry(
                            i, spec.object_group, "evicted", tier=note.tier, reason=note.reason,
                            age_s=round(self.evictions.age(note), 3),
                        )
                    )
                    continue
                other = next(
                    (fp for fp in others if any(t.contains(ObjectKey(fp, spec.object_group, h)) for t in tiers)),
                    None,
                )
                if other is not None:
                    entries.append(p.ExplainEntry(i, spec.object_group, "other_fingerprint", other_fingerprint=other.raw))
                else:
                    entries.append(p.ExplainEntry(i, spec.object_group, "never_stored"))
        return p.ExplainReply(entries=entries)

    def _tiers_named(self, name: str) -> list[Any]:
        """Every tier (``name`` empty) or the one called ``name``; ``invalid`` if there is none."""
        tiers = [t for t in self.engine.tiers if not name or t.name == name]
        if not tiers:
            names = ", ".join(t.name for t in self.engine.tiers)
            raise _Refused(p.ErrorCode.INVALID, f"no tier named {name!r}; this server has {names}")
        return tiers

    def _on_clear(self, client: _Client, msg: p.Clear) -> None:
        self._clear(client, msg.req_id, msg.fingerprint, self.engine.tiers, None)

    def _on_clear_batch(self, client: _Client, msg: p.ClearBatch) -> None:
        if not 1 <= msg.limit <= _MAX_PAGE:
            raise _Refused(p.ErrorCode.INVALID, f"clear_batch limit {msg.limit} is out of range; use 1 to {_MAX_PAGE}")
        self._clear(client, msg.req_id, msg.fingerprint, self._tiers_named(msg.tier), msg.limit)

    def _clear(self, client: _Client, req_id: int, fingerprint: bytes, tiers: list[Any], limit: int | None) -> None:
        """Delete the matching keys (at most ``limit``; ``None``: all) from ``tiers``; replies with
        how many keys went from at least one of them."""
        if fingerprint:
            try:
                Fingerprint(fingerprint)
            except KeyFormatError as exc:
                raise _Refused(p.ErrorCode.INVALID, str(exc)) from exc

        def matching(tier: Any) -> Any:
            return (k for k in tier.iter_keys() if not fingerprint or k.fingerprint.raw == fingerprint)

        def job() -> p._Msg:
            # A batch takes the first ``limit`` matching keys from an iterator (a large disk tier is
            # not listed whole per batch); deleted keys leave ``iter_keys``, so the next batch starts
            # with the next ones.
            batch: dict[ObjectKey, None] = {}
            for tier in tiers:
                remaining = None if limit is None else limit - len(batch)
                if remaining == 0:
                    break
                batch.update(dict.fromkeys(islice(matching(tier), remaining)))
            gone = 0
            for key in batch:
                held = [tier.delete(key) for tier in tiers]  # every tier, not just the first holder
                gone += any(held)
            return p.Done(count=gone)

        self._offload(client, req_id, job, lambda reply: reply)

    def _on_warm(self, client: _Client, msg: p.Warm) -> None:
        if len(msg.keys) > _MAX_PAGE:
            raise _Refused(p.ErrorCode.INVALID, f"warm takes at most {_MAX_PAGE} keys per request, got {len(msg.keys)}; send batches")
        if msg.max_bytes < 0:
            raise _Refused(p.ErrorCode.INVALID, f"warm max_bytes {msg.max_bytes} is negative; use 0 (no limit) or a byte budget")
        keys = [self._key(raw) for raw in msg.keys]

        def job() -> p._Msg:
            reply = p.WarmReply()
            for key in keys:
                if msg.max_bytes and reply.bytes >= msg.max_bytes:
                    break  # budget spent: the rest are left unexamined
                promoted = self.engine.warm(key)
                if promoted is None:
                    reply.failed += 1
                elif promoted == 0:
                    reply.present += 1
                else:
                    reply.promoted += 1
                    reply.bytes += promoted
            return reply

        self._offload(client, msg.req_id, job, lambda reply: reply)
