"""How the client's messages move: a ZMQ ``DEALER`` socket (``ipc://``, ``tcp://``) or a Unix stream
socket (``unix://``, read and written by the calling thread itself, without libzmq's I/O thread).

A wire carries a request's body and tag to the server and hands back each reply's body and tag;
what they mean is :class:`~tiercache.client.transport.Transport`'s. Both raise
:class:`~tiercache.errors.ServerUnavailableError` when a request cannot be sent. Neither is
thread-safe: the transport's lock guards its wire.
"""

from __future__ import annotations

import errno
import os
import secrets
import select
import socket
import time
from pathlib import Path
from typing import Protocol, cast

import zmq
import zmq.auth

from tiercache.errors import AuthenticationError, ServerNotListeningError, ServerUnavailableError
from tiercache.wire import protocol as p
from tiercache.wire.frames import request_frames
from tiercache.wire.stream import (
    STREAM_HEADER,
    UNIX_SCHEME,
    ZMTP_SIGNATURE,
    peer_credentials,
    speaks_zmtp,
    stream_lengths,
    stream_parts,
    stream_pieces,
)

#: zmq's flags as plain ints: the enums' operators are Python calls, a few per request.
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
#: Bytes a Unix wire reads at once.
_READ_BYTES = 256 * 1024
#: How long a connection that ended unheard waits for a ZeroMQ server's greeting (sent at once).
_GREETING_WAIT_S = 0.5
#: :attr:`UnixWire.ended` when the server closed the connection (it stopped or restarted).
_CLOSED = "closed the connection before answering (it stopped or restarted); the next call connects again"


class Wire(Protocol):
    """What the transport needs of its connection to the server."""

    def send(self, body: bytes, tag: bytes | None) -> None:
        """Send one request (raises :class:`ServerUnavailableError` if it cannot). A wire that
        finds its connection ended sends on a new one and says so in :attr:`ended`."""

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a reply to read; whether one may be there."""

    def recv(self) -> tuple[bytes, bytes | None] | None:
        """One reply's body and tag, or ``None`` if no whole reply is there now. Never waits."""

    def close(self) -> None:
        """Close the connection; replies still on the way are lost."""

    @property
    def ended(self) -> str | None:
        """Why the connection the requests in flight went on ended, said after "the server at
        ENDPOINT" (``None``: it did not): none of them will be answered, and the server ended their
        session. :meth:`resume` says it was heard."""

    def resume(self) -> None:
        """The transport heard that the connection ended: :attr:`ended` is ``None`` again."""


class ZmqWire:
    """A ``DEALER`` socket connected to ``endpoint`` (CURVE when given the server's key). libzmq
    reconnects it by itself: a request sent while the server is down waits in its queue."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        curve_server_key: bytes | None = None,
        curve_client_key_file: Path | None = None,
    ) -> None:
        self.endpoint = endpoint
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        # A fixed identity lets the server recognise us after a reconnect (and say hello_required).
        self.routing_id = b"tc-" + secrets.token_bytes(12)
        sock.setsockopt(zmq.ROUTING_ID, self.routing_id)
        try:
            if curve_server_key is not None:
                _curve(sock, curve_server_key, curve_client_key_file)
            sock.connect(endpoint)
        except BaseException:
            sock.close(0)
            raise
        self._sock = sock

    def send(self, body: bytes, tag: bytes | None) -> None:
        frames = request_frames(body, tag)
        try:
            if len(frames) == 1:  # (send_multipart's checks of its parts cost more than the send)
                self._sock.send(frames[0], _NOBLOCK)
            else:
                self._sock.send_multipart(frames, _NOBLOCK)
        except zmq.ZMQError as exc:
            raise ServerUnavailableError(
                f"cannot send to the tiercache server at {self.endpoint}: send queue full (the server is "
                "not reading: stopped or overloaded); check that it runs, then retry"
            ) from exc

    def wait(self, timeout_s: float) -> bool:
        # (zmq_poll itself: Socket.poll builds a Poller each call)
        return bool(zmq.zmq_poll([(self._sock, _POLLIN)], int(timeout_s * 1000) or 1))

    def recv(self) -> tuple[bytes, bytes | None] | None:
        # Asked, not tried: a recv that finds nothing raises, and that exception at the end of
        # every drain was a tenth of a lookup's CPU in the client.
        if not cast(int, self._sock.getsockopt(zmq.EVENTS)) & _POLLIN:  # EVENTS is an int option
            return None
        try:
            frames = self._sock.recv_multipart(_NOBLOCK)
        except zmq.Again:
            return None
        return frames[0], (frames[1] if len(frames) == 2 else None)

    def close(self) -> None:
        self._sock.close(0)

    #: libzmq reconnects by itself and says nothing: a request lost with the server times out.
    ended: str | None = None

    def resume(self) -> None:
        pass


def _curve(sock: zmq.Socket[bytes], server_key: bytes, key_file: Path | None) -> None:
    """Make ``sock`` a CURVE client of the server whose public key is ``server_key``."""
    if key_file is None:
        raise AuthenticationError(
            "a CURVE server needs this client's secret key file (curve_client_key_file)", "auth_failed"
        )
    public, secret = zmq.auth.load_certificate(key_file)
    if not secret:
        raise AuthenticationError(
            f"{key_file} holds no secret key; pass the client's .key_secret file, not its public .key",
            "auth_failed",
        )
    sock.curve_serverkey = server_key
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def refuse_other_user(endpoint: str, uid: int) -> None:
    """Raise :class:`AuthenticationError` unless ``uid``, who serves ``endpoint`` (a socket file),
    is this user or root: whoever could create that file (a squatted or shared directory) would
    read what this client stores and serve it their bytes."""
    me = os.geteuid()
    if uid not in (me, 0):
        raise AuthenticationError(
            f"the process listening at {endpoint} runs as uid {uid}, not as this user (uid {me}) or "
            "root: another local user may have put it there. Point the client at your own server's socket "
            "(in an owner-only directory: set XDG_RUNTIME_DIR, or pass the endpoint)",
            p.ErrorCode.AUTH_FAILED.value,
        )


def _probe(path: str, timeout_s: float) -> socket.socket | None:
    """A plain stream connection to the socket file ``path`` (``@NAME``: libzmq's abstract
    namespace), with ``timeout_s`` on each of its calls; ``None`` if nothing listens there."""
    if path.startswith("@"):
        path = "\0" + path[1:]
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout_s)
    try:
        probe.connect(path)
    except OSError:
        probe.close()
        return None
    return probe


def ipc_listener_uid(endpoint: str) -> int | None:
    """The uid of the process listening at ipc ``endpoint``, as the kernel says it
    (``SO_PEERCRED`` of a connection that is closed at once), or ``None`` if nothing listens."""
    probe = _probe(endpoint.removeprefix("ipc://"), 1.0)
    if probe is None:
        return None
    with probe:
        return peer_credentials(probe)[1]


def ipc_listener_is_unix(endpoint: str) -> bool:
    """Whether what listens at ipc ``endpoint``'s socket is a ``unix://`` tiercache server, not a
    ZeroMQ one: greeted as a ZeroMQ peer greets, it hangs up without a greeting of its own. False
    if nothing listens, or it greets back, or says nothing within a second."""
    probe = _probe(endpoint.removeprefix("ipc://"), 1.0)
    if probe is None:
        return False
    with probe:
        try:
            probe.sendall(ZMTP_SIGNATURE)
            return probe.recv(len(ZMTP_SIGNATURE)) == b""
        except OSError:  # reset, or silent (a timeout): not known to be unix://
            return False


def zeromq_greets(path: str) -> bool:
    """Whether a ZeroMQ socket (an ``ipc://`` endpoint) listens at ``path``: it greets a new
    connection at once, where a ``unix://`` server says nothing until asked."""
    probe = _probe(path, _GREETING_WAIT_S)
    if probe is None:
        return False
    with probe:
        try:
            return speaks_zmtp(probe.recv(len(ZMTP_SIGNATURE)))
        except OSError:  # silent (a timeout)
            return False


class UnixWire:
    """A Unix stream socket to the server at ``endpoint`` (``unix:///path``), connected on the first
    send and again on the first send after the server closed it (a restarted server then asks for
    a hello). The server must run as this user or root: the kernel says who accepted
    (``SO_PEERCRED``). A send waits up to ``timeout_s`` for the server to take the request."""

    def __init__(self, endpoint: str, timeout_s: float) -> None:
        self.endpoint = endpoint
        self._path = endpoint.removeprefix(UNIX_SCHEME)
        self._timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._ended: str | None = None
        self._heard = False
        self._poll = select.poll()
        self._inbox = bytearray()
        # Every read lands here first: a fresh buffer per recv() would be an allocation per reply.
        self._buffer = bytearray(_READ_BYTES)
        self._view = memoryview(self._buffer)

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._timeout_s)
            sock.connect(self._path)
            refuse_other_user(self.endpoint, peer_credentials(sock)[1])
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            nobody = isinstance(exc, (FileNotFoundError, ConnectionRefusedError))
            raise (ServerNotListeningError if nobody else ServerUnavailableError)(
                f"cannot connect to the tiercache server at {self.endpoint} ({exc.strerror or exc}); check that "
                "it runs and that the endpoint matches its --listen"
            ) from exc
        except BaseException:
            sock.close()
            raise
        self._poll.register(sock.fileno(), select.POLLIN)
        self._sock = sock
        self._inbox.clear()
        self._heard = False  # nothing from the server on this connection yet
        return sock

    def send(self, body: bytes, tag: bytes | None) -> None:
        pieces = stream_pieces(body, tag)
        try:
            sent = self._send(self._sock or self._connect(), pieces)
            if sent == 0:
                # The connection had ended before this request (a restarted server, whose closing
                # this client had not read yet): nothing of it was sent, so it goes once more on a
                # new one, where the server asks for a hello, as a ZMQ socket would reconnect.
                # The requests sent on the old one will not be answered.
                self.close()
                self._ended = _CLOSED
                self._send(self._connect(), pieces)
        except OSError as exc:
            self.close()  # a request cut short would garble the next one
            raise ServerUnavailableError(
                f"cannot send to the tiercache server at {self.endpoint} ({exc.strerror or exc}); check that it "
                "runs, then retry"
            ) from exc

    def _send(self, sock: socket.socket, pieces: list[bytes | memoryview]) -> int:
        """Send ``pieces`` whole, waiting up to the timeout for the server to take them; 0 if the
        connection had already ended (nothing sent), else the bytes sent."""
        deadline = time.monotonic() + self._timeout_s
        done = 0
        for piece in pieces:
            view = memoryview(piece)
            while view:
                try:
                    sent = sock.send(view)
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    if left <= 0 or not select.select([], [sock], [], left)[1]:
                        raise TimeoutError(
                            errno.ETIMEDOUT, "the server took no more of the request"
                        ) from None
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    if done == 0:
                        return 0
                    raise
                done += sent
                view = view[sent:]
        return done

    def wait(self, timeout_s: float) -> bool:
        if self._sock is None:
            time.sleep(timeout_s)  # nothing can come: as a wait on a socket nobody answers
            return False
        if self._whole_message() is not None:
            return True
        return bool(self._poll.poll(int(timeout_s * 1000) or 1))

    def recv(self) -> tuple[bytes, bytes | None] | None:
        if self._sock is None:
            return None
        taken = self._take()
        if taken is not None:
            return taken
        try:
            got = self._sock.recv_into(self._buffer)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            got = 0
        if not got:  # the server closed the connection: the next send connects again
            heard = self._heard
            self.close()
            # A ZeroMQ server (``ipc://``) may hang up on a request before its greeting is read.
            self._ended = _CLOSED if heard or not zeromq_greets(self._path) else self._speaks_zeromq()
            return None
        if not self._heard:  # a connection's first bytes
            self._heard = True
            if speaks_zmtp(self._buffer):  # a ZeroMQ server's greeting: nothing it sends is a reply
                self.close()
                self._ended = self._speaks_zeromq()
                return None
        self._inbox += self._view[:got]
        return self._take()

    def _speaks_zeromq(self) -> str:
        path = self._path
        return (
            f"speaks ZeroMQ: it listens on ipc://{path}, not unix://{path}; connect with ipc://{path} "
            f"(or start the server with --listen unix://{path})"
        )

    def _whole_message(self) -> tuple[int, int] | None:
        """The lengths of the inbox's first message if all of it is there."""
        lengths = stream_lengths(self._inbox)
        if lengths is None or len(self._inbox) < STREAM_HEADER.size + sum(lengths):
            return None
        return lengths

    def _take(self) -> tuple[bytes, bytes | None] | None:
        """The first whole reply in the inbox, taken out of it (``None``: none is whole)."""
        lengths = self._whole_message()
        if lengths is None:
            return None
        taken = stream_parts(self._inbox, 0, *lengths)
        del self._inbox[: STREAM_HEADER.size + sum(lengths)]
        return taken

    @property
    def ended(self) -> str | None:
        return self._ended

    def resume(self) -> None:
        self._ended = None

    def close(self) -> None:
        if self._sock is not None:
            self._poll.unregister(self._sock.fileno())
            self._sock.close()
            self._sock = None
        self._inbox.clear()


__all__ = ["UnixWire", "Wire", "ZmqWire", "ipc_listener_is_unix", "ipc_listener_uid", "refuse_other_user"]
