"""The one Python client of the tiercache server: used by the vLLM connector, the CLI and the tests.

Runs in the caller's process (a vLLM scheduler or worker, a tool). One ZMQ ``DEALER`` socket per
:class:`Client`, guarded by a lock, so one client may be shared by threads. Three ways to talk:

* **sync** methods per op (:meth:`Client.lookup`, :meth:`Client.reserve`, ...) that wait up to a
  timeout and raise :class:`~tiercache.errors.ServerError` (``.code`` tells which refusal),
  :class:`~tiercache.errors.ProtocolError`, :class:`~tiercache.errors.AuthenticationError` or
  :class:`~tiercache.errors.ServerUnavailableError`;
* **non-blocking** for the scheduler: :meth:`Client.lookup_async` / :meth:`Client.poll_ticket_async`
  return a request id at once, :meth:`Client.poll` returns the result or ``None`` without waiting;
* **data path** helpers that move bytes through the shared arena, never through the socket:
  :meth:`Client.store_chunks` (reserve → copy in → commit) and :meth:`Client.load_chunks` /
  :meth:`Client.read_ticket` (pin or lookup → copy out → release). The arena is attached lazily.

A background thread (``tiercache-client-heartbeat``) pings while the client is idle so the server
keeps its reservations and leases. A ping only has to arrive: it is never waited for, so a server
stalled past the client's timeout (but not past the heartbeat timeout) keeps the session and what
it holds, where a timed-out ping would have dropped the socket and started a new session. If the server restarts, the socket reconnects by itself and the
next request says hello again (the server answers ``hello_required``); calls made while it is down
raise :class:`ServerUnavailableError`.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import msgspec
import zmq
import zmq.auth

from tiercache.client.transfer import Load, Store
from tiercache.config.parts import default_endpoint, default_runtime_dir, runtime_dir_problem
from tiercache.errors import (
    AuthenticationError,
    ConfigError,
    ProtocolError,
    ServerError,
    ServerUnavailableError,
)
from tiercache.keys.digest import digest
from tiercache.keys.fingerprint import Fingerprint, LayoutManifest
from tiercache.keys.object_key import ObjectKey
from tiercache.l1.arena import SharedArena
from tiercache.wire import protocol as p
from tiercache.wire.auth import SessionSeal, auth_proof, session_key
from tiercache.wire.frames import request_frames

Buffer = bytes | bytearray | memoryview
T = TypeVar("T")

_PROTOCOL_CODES = {p.ErrorCode.MALFORMED, p.ErrorCode.UNKNOWN_OP, p.ErrorCode.VERSION_MISMATCH}


#: What the server said in its hello reply (chunk size, arena name and size, heartbeat, limits).
ServerInfo = p.HelloReply

#: A lookup's answer: restorable ``chunks``, objects per tier, and the promotion ticket's state and
#: (when ``ready``) its pinned slots. See :class:`~tiercache.wire.protocol.LookupReply`.
LookupResult = p.LookupReply


# Reply → result converters (for ``Client._call``) whose result type is the protocol's.
def _count(reply: p.Done) -> int:
    return reply.count


def _data(reply: p.DataReply) -> bytes | None:
    return reply.data


@dataclass(slots=True)
class _Pending:
    convert: Callable[[Any], Any]
    deadline: float
    reply: Any = None
    done: bool = False
    #: An asynchronous request, kept to be sent once more if the server answers hello_required (it
    #: restarted and forgot the session); ``None`` once resent, or for synchronous calls.
    msg: p.Message | None = None


@dataclass(slots=True)
class _State:
    """Socket-side state; guarded by ``Client._lock``."""

    sock: zmq.Socket[bytes] | None = None
    hello: ServerInfo | None = None
    pending: dict[int, _Pending] = field(default_factory=dict)
    last_send: float = 0.0
    #: Async requests given up on (their timeout passed) whose late reply may still come: a ticket
    #: it carries is released at once, so nothing stays pinned for a caller that gave up.
    abandoned: set[int] = field(default_factory=set)
    #: The session key's seal, from the hello of a client with a shared secret: signs every request
    #: after the handshake and checks every reply (:mod:`tiercache.wire.auth`).
    seal: SessionSeal | None = None
    #: Replies dropped because the server did not sign them (forged, or from another session).
    unsigned_replies: int = 0


#: Timed-out async requests remembered for their late replies; beyond this many, none will come.
_MAX_ABANDONED = 4096
#: Refusals a shared-secret server cannot sign (it holds no session for us, or our hello failed),
#: believed unsigned: the worst a forged one does is make the client say hello again or give up.
_UNSIGNED_CODES = frozenset({p.ErrorCode.HELLO_REQUIRED, p.ErrorCode.AUTH_FAILED})


def _events(since: int, fingerprints: Sequence[Fingerprint], limit: int) -> p.Events:
    return p.Events(since=since, fingerprints=[f.raw for f in fingerprints], limit=limit)


def _lookup(
    hashes: Sequence[bytes],
    groups: Sequence[p.GroupRef],
    prefetch: bool,
    max_chunks: int,
    inflight_wait_s: float,
    tenant: bytes,
    kind: p.LookupKind = p.LookupKind.CHUNKS,
) -> p.Lookup:
    return p.Lookup(
        hashes=list(hashes),
        groups=list(groups),
        prefetch=prefetch,
        max_chunks=max_chunks,
        inflight_wait_s=inflight_wait_s,
        tenant=tenant,
        kind=kind,
    )


class Client:
    """Connect to a tiercache server at ``endpoint`` (default: the server's default ipc socket).

    ``timeout`` bounds every sync call unless the call passes its own. ``auth_secret`` answers a
    shared-secret server; ``curve_server_key`` (the server's public key, z85 bytes) plus
    ``curve_client_key_file`` (this client's ``zmq.auth`` secret key file, whose public half the
    server admits) talk to a CURVE server. Connecting and saying hello happen in the constructor
    (one round trip, or two with a shared secret). ``io_cpus`` are the CPUs libzmq's background
    threads (its I/O thread moves every request and reply) run on; by default they inherit the
    binding of the thread that creates the client.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = 5.0,
        auth_secret: str | None = None,
        curve_server_key: bytes | None = None,
        curve_client_key_file: Path | None = None,
        client_name: str = "",
        heartbeat: bool = True,
        on_thread_start: Callable[[], None] | None = None,
        io_cpus: Collection[int] | None = None,
    ) -> None:
        if endpoint is None:
            # The default endpoint's directory may be in /tmp: only trust one of this user's own.
            problem = runtime_dir_problem(default_runtime_dir())
            if problem is not None:
                raise ConfigError(problem)
        self.endpoint = endpoint or default_endpoint()
        self.timeout = timeout
        self._secret = auth_secret
        self._curve_server_key = curve_server_key
        self._curve_key_file = curve_client_key_file
        self._name = client_name
        self._codec = p.Codec()
        self._ids = itertools.count(1)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # libzmq starts its I/O thread (which moves every message of the socket, both ways) with
        # the first socket, bound like the thread that creates it unless told otherwise.
        for cpu in io_cpus or ():
            self._ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
        self._lock = threading.RLock()  # guards _state, the socket and _codec
        self._state = _State()
        self._arena: SharedArena | None = None  # guarded by _lock
        self._closed = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._on_thread_start = on_thread_start  # run first on the heartbeat thread (e.g. its CPUs)
        try:
            self._connect()
            self.hello()
        except BaseException:
            self.close()
            raise
        if heartbeat:
            self._heartbeat = threading.Thread(
                target=self._beat, name="tiercache-client-heartbeat", daemon=True
            )
            self._heartbeat.start()

    # -- connection --------------------------------------------------------------------------------
    def _connect(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        # A fixed identity lets the server recognise us after a reconnect (and say hello_required).
        sock.setsockopt(zmq.ROUTING_ID, b"tc-" + secrets.token_bytes(12))
        if self._curve_server_key is not None:
            if self._curve_key_file is None:
                raise AuthenticationError(
                    "a CURVE server needs this client's secret key file (curve_client_key_file)",
                    "auth_failed",
                )
            public, secret = zmq.auth.load_certificate(self._curve_key_file)
            if not secret:
                raise AuthenticationError(
                    f"{self._curve_key_file} holds no secret key; pass the client's .key_secret file, not its public "
                    ".key",
                    "auth_failed",
                )
            sock.curve_serverkey = self._curve_server_key
            sock.curve_publickey = public
            sock.curve_secretkey = secret
        sock.connect(self.endpoint)
        self._state.sock = sock

    def _reset(self) -> None:
        """Drop the socket (stale replies with it) and make a fresh one; hello again on next use."""
        st = self._state
        if st.sock is not None:
            st.sock.close(0)
        st.sock = None
        st.hello = None
        st.pending.clear()
        st.abandoned.clear()  # a new socket is a new session: the server frees the old one's tickets
        st.seal = None
        if not self._closed.is_set():
            self._connect()

    def close(self) -> None:
        """Stop the heartbeat, close the socket and unmap the arena. Idempotent.

        Open reservations and leases are freed by the server once the heartbeat timeout passes.
        """
        self._closed.set()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(2.0)
        with self._lock:
            if self._state.sock is not None:
                self._state.sock.close(0)
                self._state.sock = None
            if self._arena is not None:
                self._arena.close()
                self._arena = None
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _beat(self) -> None:
        if self._on_thread_start is not None:
            self._on_thread_start()
        while not self._closed.is_set():
            info = self._state.hello
            interval = (info.heartbeat_timeout_s if info else 15.0) / 3
            if self._closed.wait(min(interval, 1.0)):
                return
            if time.monotonic() - self._state.last_send < interval:
                continue
            if not self._lock.acquire(timeout=0.1):
                continue  # someone is talking to the server: that is a heartbeat too
            try:
                self._send_ping()
            except Exception:  # down or restarting: the next real call reports it
                pass
            finally:
                self._lock.release()

    def _send_ping(self) -> None:
        """Send a ping and forget it (its reply is dropped when it comes). Caller holds the lock.

        Not a round trip: a late reply must not reset the socket (a new routing id is a new
        session, which would orphan the reservations and leases this client still uses), and the
        server counts the ping as a sign of life when it arrives, whenever it answers."""
        st = self._state
        if st.hello is None or st.sock is None:
            return  # nothing held yet, or the next real call says hello first
        self._drain(0)  # the earlier pings' replies (an idle client's socket would pile them up)
        req_id = self._send(p.Ping(), lambda r: r, None)
        st.pending.pop(req_id, None)
        if len(st.abandoned) >= _MAX_ABANDONED:
            st.abandoned.clear()
        st.abandoned.add(req_id)

    # -- request machinery -----------------------------------------------------------------------
    def _send(
        self, msg: p.Message, convert: Callable[[Any], Any], timeout: float | None, req_id: int | None = None
    ) -> int:
        """Send ``msg`` under a new request id (or ``req_id``: a resend) and file its pending reply."""
        if self._closed.is_set():
            raise ServerUnavailableError("this client is closed; create a new one")
        req_id = next(self._ids) if req_id is None else req_id
        msg.req_id = req_id
        st = self._state
        if st.sock is None:
            self._connect()
        assert st.sock is not None
        try:
            self._write(st.sock, msg)
        except zmq.Again as exc:
            raise ServerUnavailableError(
                f"cannot send to the tiercache server at {self.endpoint}: send queue full (the server is "
                "not reading: stopped or overloaded); check that it runs, then retry"
            ) from exc
        st.last_send = time.monotonic()
        st.pending[req_id] = _Pending(
            convert, time.monotonic() + (self.timeout if timeout is None else timeout)
        )
        return req_id

    def _write(self, sock: zmq.Socket[bytes], msg: p.Message) -> None:
        """Encode and send ``msg`` in frames the server takes (:mod:`tiercache.wire.frames`), with
        its tag after the handshake of a shared-secret session."""
        body = self._codec.encode(msg)
        info = self._state.hello
        if info is not None and len(body) > info.max_message_bytes:
            # The server would read it only to refuse it (and could not say which request it was).
            raise ServerError(
                f"a {msg.__class__.__name__.lower()} of {len(body)} bytes exceeds the server's "
                f"max_message_bytes {info.max_message_bytes}; store large chunks through the arena",
                p.ErrorCode.TOO_LARGE.value,
            )
        seal = self._state.seal
        tag = None if seal is None or isinstance(msg, (p.Hello, p.Challenge)) else seal.seal(body)
        sock.send_multipart(request_frames(body, tag), zmq.NOBLOCK)

    def _drain(self, wait_s: float) -> None:
        """Receive replies (waiting up to ``wait_s`` for the first) and file them by ``req_id``."""
        sock = self._state.sock
        assert sock is not None
        if wait_s > 0 and not sock.poll(int(wait_s * 1000) or 1, zmq.POLLIN):
            return
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            frame = frames[0]
            try:
                reply = self._codec.replies.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
                raise ProtocolError(
                    f"undecodable reply from the server at {self.endpoint}: {exc}; use the same tiercache version "
                    "for the server and its clients",
                    "malformed",
                ) from exc
            if not self._believe(reply, frame, frames[1] if len(frames) == 2 else None):
                self._state.unsigned_replies += 1
                continue
            entry = self._state.pending.get(reply.req_id)
            if entry is not None:
                entry.reply, entry.done = reply, True
            elif reply.req_id in self._state.abandoned:
                self._state.abandoned.discard(reply.req_id)
                if isinstance(reply, p.LookupReply) and reply.ticket:
                    self._release_late_ticket(reply.ticket)

    def _believe(self, reply: p.Message, frame: bytes, tag: bytes | None) -> bool:
        """Whether a reply comes from the server this session proved the secret to: with a shared
        secret every reply carries the session's fresh tag, save the refusals it cannot sign."""
        seal = self._state.seal
        if seal is None:
            return tag is None
        if tag is not None:
            return seal.open(frame, tag)
        return isinstance(reply, p.ErrorReply) and reply.code in _UNSIGNED_CODES

    def _release_late_ticket(self, ticket: int, read: bool = False) -> None:
        """Release a ticket; fire and forget. Lost, the ticket goes with its leases or session."""
        self._send_unanswered(p.ReleaseTicket(ticket=ticket, read=read))

    def _send_unanswered(self, msg: p.Message) -> None:
        """Send ``msg`` if the socket takes it, without waiting for its reply (which matches no
        pending request: dropped). Called with ``_lock`` held."""
        sock = self._state.sock
        if sock is None:
            return
        msg.req_id = next(self._ids)
        try:
            self._write(sock, msg)
        except zmq.ZMQError:
            return
        self._state.last_send = time.monotonic()

    def _result(self, req_id: int) -> Any:
        entry = self._state.pending.pop(req_id)
        reply = entry.reply
        if isinstance(reply, p.ErrorReply):
            raise self._error(reply)
        return entry.convert(reply)

    @staticmethod
    def _error(reply: p.ErrorReply) -> ServerError:
        code = reply.code
        if code is p.ErrorCode.AUTH_FAILED:
            return AuthenticationError(reply.message, code.value)
        if code in _PROTOCOL_CODES:
            return ProtocolError(reply.message, code.value)
        return ServerError(f"{code.value}: {reply.message}", code.value)

    def _call(
        self, msg: p.Message, convert: Callable[[Any], T] = lambda r: r, timeout: float | None = None
    ) -> T:
        """Send, wait for the reply and return ``convert(reply)`` (the reply itself by default), typed as
        ``convert`` or the caller says: nothing checks it at run time. Says hello again once if the
        server forgot us (restart)."""
        with self._lock:
            for attempt in (0, 1):
                if self._state.hello is None and not isinstance(msg, (p.Hello, p.Challenge)):
                    self._say_hello(timeout)
                req_id = self._send(msg, convert, timeout)
                entry = self._state.pending[req_id]
                while not entry.done:
                    left = entry.deadline - time.monotonic()
                    if left <= 0:
                        self._drain(0)  # a reply that came while this thread was not running
                        if entry.done:
                            break
                        self._reset()
                        raise ServerUnavailableError(
                            f"no reply from the tiercache server at {self.endpoint} within "
                            f"{self.timeout if timeout is None else timeout:g} s; is it running?"
                        )
                    self._drain(left)
                reply = entry.reply
                if (
                    attempt == 0
                    and isinstance(reply, p.ErrorReply)
                    and reply.code is p.ErrorCode.HELLO_REQUIRED
                    and not isinstance(msg, (p.Hello, p.Challenge))
                ):
                    self._state.pending.pop(req_id)
                    self._state.hello = None
                    continue
                return cast(T, self._result(req_id))
        raise AssertionError("unreachable")

    def _say_hello(self, timeout: float | None) -> ServerInfo:
        st = self._state
        st.seal = None  # a new handshake: the challenge's reply comes unsigned
        dropped = st.unsigned_replies
        auth = client_nonce = b""
        if self._secret:
            nonce = self._call(p.Challenge(), lambda r: r.nonce, timeout)
            auth = auth_proof(self._secret, nonce)
            client_nonce = secrets.token_bytes(16)
            # Before the hello is sent: its reply must already carry the new session's tag.
            st.seal = SessionSeal(session_key(self._secret, nonce, client_nonce), to_server=True)
        msg = p.Hello(
            protocol_version=p.PROTOCOL_VERSION, client_name=self._name, auth=auth, client_nonce=client_nonce
        )
        try:
            info: ServerInfo = self._call(msg, timeout=timeout)
        except ServerUnavailableError as exc:
            if self._secret and st.unsigned_replies > dropped:
                raise AuthenticationError(
                    f"the server at {self.endpoint} answered the hello without proving the shared secret "
                    "(it runs without --auth-secret, with another secret, or something between rewrote its "
                    "reply); give the server and this client the same secret",
                    p.ErrorCode.AUTH_FAILED.value,
                ) from exc
            raise
        st.hello = info
        if self._arena is not None and self._arena.name != info.arena_name:
            self._arena.close()  # the server restarted with a new arena
            self._arena = None
        return info

    # -- handshake and liveness ------------------------------------------------------------------
    def hello(self, timeout: float | None = None) -> ServerInfo:
        """Say hello (version check, authentication); returns what the server reported. Round trip."""
        with self._lock:
            return self._say_hello(timeout)

    @property
    def server(self) -> ServerInfo:
        """The last hello reply (says hello first if needed)."""
        info = self._state.hello
        return info if info is not None else self.hello()

    def ping(self, timeout: float | None = None) -> None:
        """One round trip; raises :class:`ServerUnavailableError` if nobody answers in time."""
        self._call(p.Ping(), timeout=timeout)

    # -- registration ----------------------------------------------------------------------------
    def register(
        self, groups: Sequence[tuple[int, LayoutManifest]], timeout: float | None = None
    ) -> list[p.GroupRef]:
        """Register an engine's object groups ``(group id, manifest)``; returns their refs
        (fingerprint + group) for lookups. Round trip; the server stores manifests on L2/L3."""
        msg = p.RegisterEngine(groups=[p.RegisterGroup(g, m.to_dict()) for g, m in groups])
        return self._call(msg, lambda r: r.groups, timeout)

    def manifest(self, fingerprint: Fingerprint, timeout: float | None = None) -> LayoutManifest | None:
        """The manifest stored for ``fingerprint``, or ``None``."""
        d = self._call(p.GetManifest(fingerprint=fingerprint.raw), lambda r: r.manifest, timeout)
        return None if d is None else LayoutManifest.from_dict(d)

    # -- lookup ----------------------------------------------------------------------------------
    def lookup(
        self,
        hashes: Sequence[bytes],
        groups: Sequence[p.GroupRef],
        *,
        prefetch: bool = True,
        max_chunks: int = 0,
        inflight_wait_s: float = 0.0,
        tenant: bytes = b"",
        timeout: float | None = None,
        kind: p.LookupKind = p.LookupKind.CHUNKS,
    ) -> LookupResult:
        """Longest restorable prefix; with ``prefetch`` also a promotion ticket (waiting up to
        ``inflight_wait_s`` for objects still being stored: :class:`~tiercache.wire.protocol.Lookup`),
        asked for ``tenant``. ``kind``: what the hashes are (chunks, or a chunk's tail blocks) and
        what the reply counts (:class:`~tiercache.wire.protocol.LookupKind`). One round trip."""
        msg = _lookup(hashes, groups, prefetch, max_chunks, inflight_wait_s, tenant, kind)
        return self._call(msg, timeout=timeout)

    def lookup_async(
        self,
        hashes: Sequence[bytes],
        groups: Sequence[p.GroupRef],
        *,
        prefetch: bool = True,
        max_chunks: int = 0,
        inflight_wait_s: float = 0.0,
        tenant: bytes = b"",
        kind: p.LookupKind = p.LookupKind.CHUNKS,
    ) -> int:
        """Send a lookup (as :meth:`lookup`) and return its request id at once; collect it with
        :meth:`poll`."""
        msg = _lookup(hashes, groups, prefetch, max_chunks, inflight_wait_s, tenant, kind)
        return self._submit(msg, lambda r: r)

    def events(
        self,
        since: int = -1,
        fingerprints: Sequence[Fingerprint] = (),
        limit: int = 10_000,
        timeout: float | None = None,
    ) -> p.EventsReply:
        """The residency changes after ``since`` (``-1``: none, just the current position) of objects
        with one of ``fingerprints`` (empty: all); see :class:`~tiercache.wire.protocol.Events`.
        One round trip."""
        return self._call(_events(since, fingerprints, limit), timeout=timeout)

    def events_async(
        self, since: int = -1, fingerprints: Sequence[Fingerprint] = (), limit: int = 10_000
    ) -> int:
        """Send :meth:`events` and return its request id at once; collect it with :meth:`poll`."""
        return self._submit(_events(since, fingerprints, limit), lambda r: r)

    def poll_ticket_async(self, ticket: int) -> int:
        """Ask where a promotion ticket stands without waiting; collect with :meth:`poll`."""
        return self._submit(p.PollTicket(ticket=ticket), lambda r: r)

    def _submit(self, msg: p.Message, convert: Callable[[Any], Any]) -> int:
        with self._lock:
            if self._state.hello is None:
                self._say_hello(None)
            req_id = self._send(msg, convert, None)
            self._state.pending[req_id].msg = msg
            return req_id

    def _resend_after_hello(self, req_id: int, entry: _Pending) -> None:
        """The server restarted (``hello_required``): say hello again (one round trip, as
        :meth:`_submit` does after a reconnect) and send ``entry``'s request once more under the
        same id, so its caller's :meth:`poll` goes on as if nothing happened."""
        msg = entry.msg
        assert msg is not None
        self._state.pending.pop(req_id)  # a failure below leaves nothing to poll for
        self._state.hello = None
        self._say_hello(None)
        self._send(msg, entry.convert, None, req_id=req_id)  # not kept again: resent once at most

    def poll(self, req_id: int, wait_s: float = 0.0) -> Any:
        """The result of an ``*_async`` request, or ``None`` if it has not arrived; waits up to
        ``wait_s`` for a reply to come (never, by default).

        Raises the request's error, or :class:`ServerUnavailableError` once its timeout passed; a
        lookup's late reply is then dropped, and its ticket released (the caller gave up on it).
        """
        with self._lock:
            entry = self._state.pending.get(req_id)
            if entry is None:
                raise ServerError(
                    f"request {req_id} is unknown or already collected; poll each request id until it returns a "
                    "result, once",
                    "unknown_token",
                )
            if not entry.done:
                self._drain(0)
            deadline = time.monotonic() + wait_s
            while not entry.done and (left := deadline - time.monotonic()) > 0:
                self._drain(left)  # returns on the first reply, which may be another request's
            if (
                entry.done
                and entry.msg is not None
                and isinstance(entry.reply, p.ErrorReply)
                and entry.reply.code is p.ErrorCode.HELLO_REQUIRED
            ):
                self._resend_after_hello(req_id, entry)
                return None
            if entry.done:
                return self._result(req_id)
            if time.monotonic() > entry.deadline:
                self._state.pending.pop(req_id)
                if len(self._state.abandoned) >= _MAX_ABANDONED:  # replies that will never come
                    self._state.abandoned.clear()
                self._state.abandoned.add(req_id)
                raise ServerUnavailableError(
                    f"no reply to request {req_id} from {self.endpoint} in time; check that the server runs and is "
                    "not overloaded (tiercache inspect summary), or raise the client timeout"
                )
            return None

    def poll_ticket(self, ticket: int, timeout: float | None = None) -> LookupResult:
        """Where a promotion ticket stands. One round trip."""
        return self._call(p.PollTicket(ticket=ticket), timeout=timeout)

    def wait_ticket(self, ticket: int, timeout: float | None = None) -> LookupResult:
        """Poll ``ticket`` until it is no longer pending (tools and tests; a scheduler polls)."""
        end = time.monotonic() + (self.timeout if timeout is None else timeout)
        pause = 0.0005
        while True:
            result = self.poll_ticket(ticket)
            if not result.pending:
                return result
            if time.monotonic() > end:
                return result
            time.sleep(pause)  # promotions take ms: back off instead of spinning on the server
            pause = min(pause * 2, 0.01)

    def release_ticket(self, ticket: int, timeout: float | None = None, *, read: bool = False) -> None:
        """Unpin everything a ticket holds. ``read``: this client copied the objects from the
        ticket's slots (the server counts them as L1 reads: :class:`~tiercache.wire.protocol.ReleaseTicket`)."""
        self._call(p.ReleaseTicket(ticket=ticket, read=read), timeout=timeout)

    def release_ticket_unconfirmed(self, ticket: int, *, read: bool = False) -> None:
        """:meth:`release_ticket` without waiting for the reply (a round trip less). For a reader
        that learns nothing from the reply: whether its copy was inside the ticket's leases it
        decides by time (:class:`~tiercache.client.transfer.Window`). A ticket whose release is lost ends with its
        leases' TTL or its session."""
        with self._lock:
            self._release_late_ticket(ticket, read)

    # -- two-phase store / pin -------------------------------------------------------------------
    def reserve(
        self,
        items: Sequence[tuple[ObjectKey, int]],
        timeout: float | None = None,
        *,
        tenants: Sequence[bytes] = (),
        holds: Sequence[tuple[bytes, Sequence[bytes]]] = (),
    ) -> list[p.Slot]:
        """Reserve arena slots for ``(key, nbytes)``, all or nothing (``ServerError`` code
        ``tier_full`` when L1 has no room). ``tenants``: each item's tenant id, or empty for the
        default tenant's. ``holds``: ``(prefix hash, block hashes)`` of the tails and chunks being
        stored, for the server's block index (:class:`~tiercache.wire.protocol.Reserve`)."""
        if tenants and len(tenants) != len(items):
            raise ValueError(f"{len(items)} items but {len(tenants)} tenants")
        # All the default tenant's: say nothing (an older server accepts the message too).
        named = list(tenants) if any(tenants) else []
        msg = p.Reserve(
            items=[(k.to_bytes(), n) for k, n in items],
            tenants=named,
            holds=[(target, list(blocks)) for target, blocks in holds],
        )
        return self._call(msg, lambda r: r.slots, timeout)

    def commit(
        self,
        tokens: Sequence[int],
        digests: Sequence[int],
        timeout: float | None = None,
        supersedes: Sequence[ObjectKey] = (),
    ) -> int:
        """Make reservations visible, each with its payload's digest (the writer's, over its own
        bytes: :mod:`tiercache.keys.digest`); ``supersedes``: tails the committed chunks cover,
        dropped from the server's local tiers (:class:`~tiercache.wire.protocol.Commit`). Prefer
        :class:`~tiercache.client.transfer.Store`, which keeps the data path's rules."""
        msg = p.Commit(
            tokens=list(tokens), digests=list(digests), supersedes=[k.to_bytes() for k in supersedes]
        )
        return self._call(msg, _count, timeout)

    def abort(self, tokens: Sequence[int], timeout: float | None = None) -> int:
        return self._call(p.Abort(tokens=list(tokens)), _count, timeout)

    def pin(self, keys: Sequence[ObjectKey], timeout: float | None = None) -> list[p.Slot | None]:
        """Lease the L1 copies of ``keys`` (``None`` for each not in L1)."""
        return self._call(p.Pin(keys=[k.to_bytes() for k in keys]), lambda r: r.slots, timeout)

    def release(self, tokens: Sequence[int], timeout: float | None = None) -> int:
        """End read leases; how many. Use :meth:`release_leases` to learn which had expired."""
        return self._call(p.Release(tokens=list(tokens)), _count, timeout)

    def release_leases(self, tokens: Sequence[int], timeout: float | None = None) -> set[int]:
        """End read leases and return the tokens whose lease had expired before the release: the
        bytes copied under them may be another object's (the server reused the slot), so a copy
        made under one must be thrown away. Raises like every call; then no lease is confirmed."""
        return self._call(p.Release(tokens=list(tokens)), lambda r: set(r.lost), timeout)

    def release_unanswered(self, tokens: Sequence[int]) -> None:
        """End read leases without waiting for the reply (a round trip less per load): for a reader
        whose copy time alone vouches for (:class:`~tiercache.client.transfer.Window`). Unsent,
        the leases end with their TTL or the session."""
        if tokens:
            with self._lock:
                self._send_unanswered(p.Release(tokens=list(tokens)))

    def report_corrupt(self, slots: Sequence[p.Slot]) -> None:
        """Tell the server these slots' copies did not match their digests (it re-checks them,
        drops corrupt objects and counts them); not waited for."""
        msg = p.Corrupt(objects=[(s.key, s.offset, s.nbytes) for s in slots])
        with self._lock:
            self._send_unanswered(msg)

    def clock(self) -> float:
        """What holds are timed by (:class:`~tiercache.client.transfer.Window`): ``time.monotonic()``,
        one clock for every process of this host."""
        return time.monotonic()

    @property
    def lease_window_s(self) -> float:
        """How long a lease surely holds after its pin was sent: ``min(lease_ttl_s,
        heartbeat_timeout_s)`` of the last hello; 0 before a hello or from a server that does not
        say its lease TTL. Reads no socket and takes no lock."""
        info = self._state.hello
        if info is None or info.lease_ttl_s <= 0:
            return 0.0
        return min(info.lease_ttl_s, info.heartbeat_timeout_s)

    @property
    def reservation_window_s(self) -> float:
        """How long a reservation surely holds after its reserve was sent: ``min(reservation_ttl_s,
        heartbeat_timeout_s)`` of the last hello; 0 before a hello or from a server that does not
        say it. Reads no socket and takes no lock."""
        info = self._state.hello
        if info is None or info.reservation_ttl_s <= 0:
            return 0.0
        return min(info.reservation_ttl_s, info.heartbeat_timeout_s)

    # -- the arena data path ---------------------------------------------------------------------
    def arena(self) -> SharedArena:
        """The server's L1 arena mapped into this process (attached on first use)."""
        with self._lock:
            info = self.server
            if self._arena is None:
                self._arena = SharedArena.attach(info.arena_name)
                # Off the copies: each page's first access through a fresh mapping is a fault.
                self._arena.populate_in_background()
            return self._arena

    def in_session(self, call: Callable[[], T]) -> tuple[T, SharedArena]:
        """``call()`` (calls on this client, e.g. a :meth:`pin` or :meth:`reserve`) and the arena
        of the server session that answered it: the one its slots' offsets are in.

        Mapping the arena after the call returns is not enough: another thread may say hello to a
        restarted server in between, and the client then maps that server's arena, where the same
        offsets hold other objects. The client's lock, held across both, keeps every other
        thread's hello out; a hello the call itself needed happens before its reply.
        """
        with self._lock:
            result = call()
            return result, self.arena()

    def store_chunks(
        self,
        keys: Sequence[ObjectKey],
        buffers: Sequence[Buffer],
        timeout: float | None = None,
        *,
        tenant: bytes = b"",
    ) -> int:
        """Store each buffer under its key (as objects of ``tenant``): reserve → copy into the arena
        → commit with each buffer's digest (:class:`~tiercache.client.transfer.Store`). Two round
        trips plus the copies; aborts the reservations if a copy fails, and stores nothing (0) if
        the copies could not start within the reservations' window."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        views = [memoryview(b).cast("B") for b in buffers]
        items = [(k, v.nbytes) for k, v in zip(keys, views)]
        store = Store.reserve(self, items, tenants=[tenant] * len(items) if tenant else (), timeout=timeout)

        def write(i: int, target: memoryview) -> int:
            target[:] = views[i]
            return digest(views[i])  # the caller's own bytes, never the slot's

        digests = store.fill(write)
        return 0 if digests is None else store.commit(digests, timeout=timeout)

    def load_chunks(self, keys: Sequence[ObjectKey], timeout: float | None = None) -> list[bytes | None]:
        """Copies of the L1 objects of ``keys`` (``None`` where not in L1, or where the copy did not
        match the object's digest or outlived its lease): pin → copy → check → release
        (:class:`~tiercache.client.transfer.Load`). Use :meth:`lookup` + :meth:`read_ticket` to
        restore from lower tiers too."""
        load = Load.pin(self, keys, timeout)
        return _copies(load)

    def read_ticket(self, result: LookupResult, *, release: bool = True) -> dict[ObjectKey, bytes]:
        """Copy out every slot of a READY lookup, each checked against its digest (then release its
        ticket unless told not to); nothing (all misses) when the lookup's slots are in an arena
        this client no longer maps, and no copy that failed its check or outlived the leases."""
        if result.state is not p.TicketStateName.READY:
            raise ServerError(
                f"ticket {result.ticket} is {result.state.value}, not ready; wait_ticket() first, or read only READY "
                "lookups",
                "invalid",
            )
        # The lookup's time is not known here: its leases are judged from now (the ticket holding
        # them is released only after the copies), and each copy is checked against its digest.
        load = Load.adopt(self, self.arena(), result.arena, list(result.slots), self.clock())
        if load is None:
            return {}  # a server restarted since the lookup (and forgot its ticket): other objects here
        try:
            copies = _copies(load)
            return {ObjectKey.from_bytes(s.key): c for s, c in zip(result.slots, copies) if c is not None}
        finally:
            if release:
                self.release_ticket(result.ticket)

    # -- bytes over the socket (tools, remote clients) ------------------------------------------
    def put(self, key: ObjectKey, data: Buffer, timeout: float | None = None) -> bool:
        """Store ``data`` through the socket; ``False`` if L1 had no room. Bounded by the
        server's max_message_bytes."""
        return bool(self._call(p.Put(key=key.to_bytes(), data=bytes(data)), _count, timeout))

    def get(self, key: ObjectKey, timeout: float | None = None) -> bytes | None:
        """A verified copy of ``key`` from the fastest tier (promoting it), through the socket."""
        return self._call(p.Get(key=key.to_bytes()), _data, timeout)

    def delete(self, key: ObjectKey, timeout: float | None = None) -> int:
        """Remove ``key`` from every tier; how many held it."""
        return self._call(p.Delete(key=key.to_bytes()), _count, timeout)

    # -- observation and management --------------------------------------------------------------
    def stats(self, timeout: float | None = None) -> dict[str, Any]:
        return self._call(p.Stats(), lambda r: r.stats, timeout)

    def list_keys(
        self,
        *,
        tier: str = "",
        fingerprint: Fingerprint | None = None,
        object_group: int = -1,
        cursor: bytes = b"",
        limit: int = 1000,
        order: str = "key",
        timeout: float | None = None,
    ) -> tuple[list[p.ListedKey], bytes]:
        """One page of keys after ``cursor`` and the cursor of the next page (``b""``: last page);
        ``order="use"`` lists one ``tier`` most recently used first (see :class:`protocol.ListKeys`)."""
        msg = p.ListKeys(
            tier=tier,
            fingerprint=b"" if fingerprint is None else fingerprint.raw,
            object_group=object_group,
            cursor=cursor,
            limit=limit,
            order=order,
        )
        return self._call(msg, lambda r: (r.keys, r.next_cursor), timeout)

    def explain(
        self, hashes: Sequence[bytes], groups: Sequence[p.GroupRef], timeout: float | None = None
    ) -> list[p.ExplainEntry]:
        """Per chunk and group: which tier holds it, or why not."""
        return self._call(p.Explain(hashes=list(hashes), groups=list(groups)), lambda r: r.entries, timeout)

    def clear(self, fingerprint: Fingerprint | None = None, timeout: float | None = None) -> int:
        """Delete everything (or one fingerprint's objects) from every tier; how many keys went."""
        msg = p.Clear(fingerprint=b"" if fingerprint is None else fingerprint.raw)
        return self._call(msg, _count, timeout)

    def clear_batch(
        self,
        limit: int,
        *,
        tier: str = "",
        fingerprint: Fingerprint | None = None,
        timeout: float | None = None,
    ) -> int:
        """Delete at most ``limit`` keys (one fingerprint's, or any) from every tier or only ``tier``;
        how many went. Call again until it returns 0 (``tiercache clear`` does, to show progress).

        ``ServerError`` code ``invalid`` for an unknown tier; ``ProtocolError`` code ``unknown_op``
        from a server older than this op.
        """
        msg = p.ClearBatch(
            limit=limit, tier=tier, fingerprint=b"" if fingerprint is None else fingerprint.raw
        )
        return self._call(msg, _count, timeout)

    def warm(
        self, keys: Sequence[ObjectKey], *, max_bytes: int = 0, timeout: float | None = None
    ) -> p.WarmReply:
        """Promote ``keys`` (at most 10 000) into L1 from lower tiers, until ``max_bytes`` (0: no
        limit) are promoted. A server older than this op answers ``ProtocolError`` code ``unknown_op``."""
        msg = p.Warm(keys=[k.to_bytes() for k in keys], max_bytes=max_bytes)
        return self._call(msg, timeout=timeout)


def _copies(load: Load) -> list[bytes | None]:
    """A checked copy of each of ``load``'s objects (``None`` where there is none, or where the copy
    did not match the object's digest or outlived its hold); finishes the load."""
    copies: list[bytes | None] = []
    corrupt: list[int] = []
    for i, slot in enumerate(load.slots):
        if slot is None:
            copies.append(None)
            continue
        out = bytearray(slot.nbytes)
        if load.copy_into(i, out):
            copies.append(bytes(out))
        else:
            corrupt.append(i)
            copies.append(None)
    lost = load.finish(corrupt)
    return [None if i in lost else c for i, c in enumerate(copies)]
