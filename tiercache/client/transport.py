"""The client's transport: one connection to the server, its handshake and its requests.

:class:`Transport` connects (ipc, tcp, CURVE: a ZMQ ``DEALER``; unix: a Unix stream socket,
:mod:`tiercache.client.wires`), says hello (version check, the shared secret's proof
and session key), signs every request and checks every reply of a signed session, matches replies
to requests by ``req_id`` (several may be in flight: the scheduler's non-blocking lookups), says
hello again when a restarted server forgot the session, and pings while idle so the server keeps
what the session holds. It knows no operation but ``hello`` and ``ping``:
:class:`~tiercache.client.client.Client` adds them.

One socket per client, guarded by a lock, so one client may be shared by threads. A ping only has
to arrive: it is never waited for, so a server stalled past the client's timeout (but not past the
heartbeat timeout) keeps the session and what it holds, where a timed-out ping would have dropped
the socket and started a new session. If the server restarts, the socket reconnects by itself and
the next request says hello again (the server answers ``hello_required``); calls made while it is
down raise :class:`~tiercache.errors.ServerUnavailableError` (on ``unix://``, the next request
connects again and says hello, and requests in flight when the server closed the connection fail
at once).
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self, TypeVar, cast

import msgspec
import zmq

from tiercache.client.wires import (
    UnixWire,
    Wire,
    ZmqWire,
    ipc_listener_is_unix,
    ipc_listener_uid,
    refuse_other_user,
)
from tiercache.config.parts import default_endpoint, default_runtime_dir, runtime_dir_problem
from tiercache.errors import (
    AuthenticationError,
    ConfigError,
    ProtocolError,
    ServerError,
    ServerUnavailableError,
)
from tiercache.wire import protocol as p
from tiercache.wire.auth import SessionSeal, auth_proof, session_key
from tiercache.wire.codec import Codec
from tiercache.wire.stream import UNIX_SCHEME

T = TypeVar("T")

_PROTOCOL_CODES = {p.ErrorCode.MALFORMED, p.ErrorCode.UNKNOWN_OP, p.ErrorCode.VERSION_MISMATCH}


@dataclass(frozen=True, slots=True)
class _Ended:
    """The reply of a request whose ``unix://`` connection ended before it was answered."""

    why: str  # :attr:`Wire.ended`


#: What the server said in its hello reply (chunk size, arena name and size, heartbeat, limits).
ServerInfo = p.HelloReply


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
    """Connection-side state; guarded by ``Transport._lock``."""

    wire: Wire | None = None
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
    #: Ticket releases held back to ride the next lookup (``Lookup.releases``).
    riders: list[p.TicketRelease] = field(default_factory=list)
    #: Lease tokens whose release is held back to ride the next pin (``Pin.releases``).
    lease_riders: list[int] = field(default_factory=list)
    #: ``time.monotonic()`` when the oldest release held back now was; 0.0 when none is.
    riders_since: float = 0.0

    def drop_riders(self) -> None:
        """Forget the releases held back (a new session holds none of the old one's holds)."""
        self.riders.clear()
        self.lease_riders.clear()
        self.riders_since = 0.0

    def forget_session(self) -> None:
        """Forget what the server's session of this connection held: the next call says hello."""
        self.hello = None
        self.seal = None
        self.abandoned.clear()  # a new session: the server frees the old one's tickets itself
        self.drop_riders()


#: The largest unsigned reply a client of a shared-secret server decodes: a refusal the server
#: cannot sign is a few hundred bytes.
_UNSIGNED_REPLY_BYTES = 4096


def _unsigned_refusal(reply: p.Message) -> bool:
    return isinstance(reply, p.ErrorReply) and reply.code in _UNSIGNED_CODES


#: Ticket releases held back for the next lookup before they go in a message of their own.
_MAX_RIDERS = 256
#: Lease releases held back for the next pin before they go in a message of their own (a pin of a
#: 128k-token prompt's pages holds 512).
_MAX_LEASE_RIDERS = 4096
#: Seconds a held-back release waits for a lookup or pin to ride before the heartbeat thread sends
#: it (the objects stay pinned until then), however busy the client is with other requests; at
#: most a quarter of the lease window (``Transport.lease_window_s``).
_RIDER_WAIT_S = 1.0
#: Timed-out async requests remembered for their late replies; beyond this many, none will come.
_MAX_ABANDONED = 4096
#: Refusals a shared-secret server cannot sign (it holds no session for us, or our hello failed),
#: believed unsigned: the worst a forged one does is make the client say hello again or give up.
_UNSIGNED_CODES = frozenset({p.ErrorCode.HELLO_REQUIRED, p.ErrorCode.AUTH_FAILED})


class Transport:
    """A connection to a tiercache server at ``endpoint`` (default: the server's default
    socket): see the module docstring. Its arguments are :class:`~tiercache.client.client.Client`'s.
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
        self._codec = Codec()
        self._ids = itertools.count(1)
        self._io_cpus = tuple(io_cpus or ())
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None  # made for the first ZMQ socket
        self._lock = threading.RLock()  # guards _state, the socket and _codec
        self._state = _State()
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
        if self.endpoint.startswith(UNIX_SCHEME):
            self._state.wire = UnixWire(self.endpoint, self.timeout)
            return
        if self._ctx is None:
            self._ctx = zmq.Context()
            # libzmq starts its I/O thread (which moves every message of the socket, both ways)
            # with the first socket, bound like the thread that creates it unless told otherwise.
            for cpu in self._io_cpus:
                self._ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
        self._state.wire = ZmqWire(self._ctx, self.endpoint, self._curve_server_key, self._curve_key_file)

    def _reset(self) -> None:
        """Drop the connection (stale replies with it) and make a fresh one; hello again on next use."""
        st = self._state
        if st.wire is not None:
            st.wire.close()
        st.wire = None
        st.pending.clear()
        st.forget_session()  # a new socket is a new session
        if not self._closed.is_set():
            self._connect()

    def close(self) -> None:
        """Stop the heartbeat, close the socket (and what :meth:`_closing` releases). Idempotent.

        Open reservations and leases are freed by the server once the heartbeat timeout passes.
        """
        self._closed.set()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(2.0)
        with self._lock:
            if self._state.wire is not None:
                self._state.wire.close()
                self._state.wire = None
            self._closing()
        if self._ctx is not None:
            self._ctx.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _beat(self) -> None:
        if self._on_thread_start is not None:
            self._on_thread_start()
        while not self._closed.is_set():
            info = self._state.hello
            interval = (info.heartbeat_timeout_s if info else 15.0) / 3
            # A held-back release lands well inside its leases (under a short lease TTL, sooner).
            rider_wait = min(_RIDER_WAIT_S, self.lease_window_s / 4 or _RIDER_WAIT_S)
            if self._closed.wait(min(interval, rider_wait)):
                return
            now = time.monotonic()
            silent = now - self._state.last_send >= interval
            since = self._state.riders_since
            if not silent and not (since and now - since >= rider_wait):
                continue
            if not self._lock.acquire(timeout=0.1):
                continue  # someone is talking to the server: that is a heartbeat too
            try:
                self._flush_riders()  # releases no lookup or pin took along: they go now, at the latest
                if silent:
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
        if st.hello is None or st.wire is None:
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
        if st.wire is None:
            self._connect()
        assert st.wire is not None
        # Held-back releases ride along (lost with the message if the send fails: leases end).
        if st.riders and isinstance(msg, p.Lookup) and not msg.releases:
            msg.releases, st.riders = st.riders, []
            st.riders_since = st.riders_since if st.lease_riders else 0.0
        elif st.lease_riders and isinstance(msg, p.Pin) and not msg.releases:
            msg.releases, st.lease_riders = st.lease_riders, []
            st.riders_since = st.riders_since if st.riders else 0.0
        self._write(st.wire, msg)
        st.last_send = time.monotonic()
        st.pending[req_id] = _Pending(
            convert, time.monotonic() + (self.timeout if timeout is None else timeout)
        )
        return req_id

    def _write(self, wire: Wire, msg: p.Message) -> None:
        """Encode and send ``msg`` as the server takes it (:mod:`tiercache.wire.frames`), with its
        tag after the handshake of a shared-secret session."""
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
        wire.send(body, tag)
        if wire.ended is not None:  # it went on a new connection: those sent before are lost
            self._connection_ended(wire, wire.ended)
            if isinstance(msg, (p.Hello, p.Challenge)):
                self._state.seal = seal  # the handshake under way keeps its own

    def _drain(self, wait_s: float, until: _Pending | None = None) -> None:
        """Receive replies (waiting up to ``wait_s`` for the first) and file them by ``req_id``;
        with ``until``, only up to that request's (the rest wait in the socket for the next
        drain: a call does not pay a read that finds nothing)."""
        wire = self._state.wire
        assert wire is not None
        if wait_s > 0 and not wire.wait(wait_s):
            return
        while (got := wire.recv()) is not None:
            frame, tag = got
            if not self._authentic(frame, tag):  # before a byte of it is decoded
                self._state.unsigned_replies += 1
                continue
            try:
                reply = self._codec.replies.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
                raise ProtocolError(
                    f"undecodable reply from the server at {self.endpoint}: {exc}; use the same tiercache version "
                    "for the server and its clients",
                    "malformed",
                ) from exc
            if tag is None and self._state.seal is not None and not _unsigned_refusal(reply):
                self._state.unsigned_replies += 1
                continue
            entry = self._state.pending.get(reply.req_id)
            if entry is not None:
                entry.reply, entry.done = reply, True
                if entry is until:
                    break
            elif reply.req_id in self._state.abandoned:
                self._state.abandoned.discard(reply.req_id)
                if isinstance(reply, p.LookupReply) and reply.ticket:
                    self._release_late_ticket(reply.ticket)
        if wire.ended is not None:
            self._connection_ended(wire, wire.ended)

    def _connection_ended(self, wire: Wire, why: str) -> None:
        """The ``unix://`` connection ended: every request still waiting for a reply fails at once
        (instead of at its timeout), and the session it held is gone with it (the next call
        connects again and says hello)."""
        wire.resume()
        st = self._state
        ended = _Ended(why)
        for entry in st.pending.values():
            if not entry.done:
                entry.reply, entry.done, entry.msg = ended, True, None
        st.forget_session()  # the server released its holds when it saw the connection close

    def _authentic(self, frame: bytes, tag: bytes | None) -> bool:
        """Whether a reply may be decoded, judged before any of it is: with a shared secret every
        reply carries the session's fresh tag, save the few refusals the server cannot sign
        (:data:`_UNSIGNED_CODES`), which are small; without one, replies carry no tag."""
        seal = self._state.seal
        if seal is None:
            return tag is None
        if tag is not None:
            return seal.open(frame, tag)
        return len(frame) <= _UNSIGNED_REPLY_BYTES

    def _hold_release(self, ticket: int, read: bool) -> None:
        """Hold a ticket's release back for the next lookup (caller holds the lock); past
        :data:`_MAX_RIDERS` of them, send them at once."""
        st = self._state
        st.riders_since = st.riders_since or time.monotonic()
        st.riders.append(p.TicketRelease(ticket, read))
        if len(st.riders) >= _MAX_RIDERS:
            self._flush_riders()

    def _hold_lease_releases(self, tokens: Sequence[int]) -> None:
        """Hold the release of leases ``tokens`` back for the next pin (caller holds the lock);
        past :data:`_MAX_LEASE_RIDERS` of them, send them at once."""
        st = self._state
        if st.hello is None:
            return  # no session: nothing of it is held any more
        st.riders_since = st.riders_since or time.monotonic()
        st.lease_riders.extend(tokens)
        if len(st.lease_riders) >= _MAX_LEASE_RIDERS:
            self._flush_riders()

    def _flush_riders(self) -> None:
        """Send the held-back releases, a message per kind, not waited for (caller holds the lock)."""
        st = self._state
        if st.hello is not None:
            if st.riders:
                riders, st.riders = st.riders, []
                self._send_unanswered(p.ReleaseTickets(releases=riders))
            if st.lease_riders:
                tokens, st.lease_riders = st.lease_riders, []
                self._send_unanswered(p.Release(tokens=tokens, quiet=True))
        st.riders_since = 0.0

    def _release_late_ticket(self, ticket: int, read: bool = False) -> None:
        """Release a ticket; fire and forget. Lost, the ticket goes with its leases or session."""
        self._send_unanswered(p.ReleaseTicket(ticket=ticket, read=read, quiet=True))

    def _send_unanswered(self, msg: p.Message) -> None:
        """Send ``msg`` if the socket takes it, without waiting for its reply (which matches no
        pending request: dropped). Called with ``_lock`` held."""
        wire = self._state.wire
        if wire is None:
            return
        msg.req_id = next(self._ids)
        try:
            self._write(wire, msg)
        except ServerUnavailableError:
            return
        self._state.last_send = time.monotonic()

    def _result(self, req_id: int) -> Any:
        entry = self._state.pending.pop(req_id)
        reply = entry.reply
        if isinstance(reply, _Ended):
            raise ServerUnavailableError(
                f"the tiercache server at {self.endpoint} {reply.why} (request {req_id})"
            )
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
                        raise self._no_reply(msg, self.timeout if timeout is None else timeout)
                    self._drain(left, entry)
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

    def _no_reply(self, msg: p.Message, timeout: float) -> ServerUnavailableError:
        """The error of a call ``msg`` that got no reply within ``timeout``. A handshake unanswered
        on ipc may have gone to a ``unix://`` server (the default scheme), which cannot read it:
        then the error says so."""
        if (
            isinstance(msg, (p.Hello, p.Challenge))
            and self.endpoint.startswith("ipc://")
            and ipc_listener_is_unix(self.endpoint)
        ):
            path = self.endpoint.removeprefix("ipc://")
            return ServerUnavailableError(
                f"the server at {path} listens on unix://{path}, not {self.endpoint}: connect with "
                f"unix://{path} (or start the server with --listen {self.endpoint})"
            )
        return ServerUnavailableError(
            f"no reply from the tiercache server at {self.endpoint} within {timeout:g} s; is it running?"
        )

    def _say_hello(self, timeout: float | None) -> ServerInfo:
        st = self._state
        self._check_listener()
        st.drop_riders()  # a new session holds none of the old one's tickets or leases
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
        self._said_hello(info)
        return info

    def _check_listener(self) -> None:
        """On ipc, refuse a server that runs as another user (not root): whoever could create the
        socket file (a squatted or shared directory) would read what this client stores and serve
        it their bytes. The kernel says who listens (``SO_PEERCRED``); nobody listening is left
        to the hello's timeout."""
        if not self.endpoint.startswith("ipc://"):
            return
        uid = ipc_listener_uid(self.endpoint)
        if uid is not None:
            refuse_other_user(self.endpoint, uid)

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

    # -- what a subclass keeps per session --------------------------------------------------------
    def _said_hello(self, info: ServerInfo) -> None:
        """Called (under the lock) with every hello's reply: the server may be a new one."""

    def _closing(self) -> None:
        """Called (under the lock) as the client closes, before the socket's context ends."""
