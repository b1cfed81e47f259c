"""The server's ``unix://`` listener: the protocol on Unix stream sockets that the request loop reads
itself, without libzmq's I/O threads.

Over ``ipc://``, every message crosses libzmq's I/O thread on each side, a hand-off each way: for a
small request that is most of what it costs both processes (``benchmarks/many_clients.py --ops
zmq,uds``). Here the loop waits on every connection's descriptor and receives and sends without
blocking. Each message is a :data:`~tiercache.wire.stream.STREAM_HEADER` and then its body and tag.

What a peer can make the server hold is bounded as on ``ipc://``: the header says a message's size
before a byte of its body is read, and one larger than its sender may send (a handshake's 16 KiB
without a session, ``max_message_bytes`` with one) is refused and its connection closed, unread. A
connection's unsent replies are bounded too (:data:`MAX_UNSENT_BYTES`): a client that stops reading
is disconnected. The socket file is owner-only, as ``ipc://``'s, and a connection from a process of
another user (save root) is closed at once (the kernel says who connected: ``SO_PEERCRED``). So is
one that opens with ZeroMQ's greeting (a client given ``ipc://`` for this socket), with a warning
that names the fix, once per process.

Each connection gets an identity of its own, never reused, which the server's sessions are keyed
by exactly as by a ZMQ routing id: a reconnected client says hello again. Unlike a ZMQ connection's,
its end is seen: the session goes with it, and what it held is released at once (its reservations
quarantined, as after a heartbeat timeout), not a heartbeat timeout later.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import select
import socket
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from tiercache.wire.stream import (
    STREAM_HEADER,
    peer_credentials,
    speaks_zmtp,
    stream_lengths,
    stream_parts,
    stream_pieces,
)

log = logging.getLogger(__name__)

#: Bytes read from one connection per turn of the loop, and whole messages taken from them: one
#: client's flood of requests waits for the next turn, after the others had theirs.
READ_BYTES = 256 * 1024
MESSAGES_PER_TURN = 256
#: Unsent reply bytes a connection may have queued before it is closed (its client is not reading).
MAX_UNSENT_BYTES = 256 * 1024 * 1024
#: Processes told that they speak ZeroMQ to this socket, remembered so that each is told once (a
#: ZeroMQ client connects again every 0.1 s); past this many, the memory starts over.
_ZMQ_PIDS_REMEMBERED = 1024
#: The loop's readiness flags (ZeroMQ's values, which its poller also uses) and epoll's.
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_ZMQ_TO_EPOLL = {_POLLIN: select.EPOLLIN, _POLLOUT: select.EPOLLOUT}
#: Every identity starts with this: no ZMQ routing id the server sees does (they are 5 bytes, or
#: the client's ``tc-`` ones).
IDENTITY_PREFIX = b"\x00ux"


class EpollPoller:
    """:class:`zmq.Poller`'s ``register`` / ``unregister`` / ``poll`` for descriptors alone, on
    epoll: what a ``unix://`` loop waits on. ZeroMQ's poller rebuilds its list of every descriptor
    each call, one per connection; epoll's cost is the ready ones'."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._registered: set[int] = set()

    def register(self, fd: int, flags: int) -> None:
        """Wait for ``flags`` (``zmq.POLLIN`` / ``zmq.POLLOUT``) on ``fd``; again: change them."""
        mask = 0
        for flag, bit in _ZMQ_TO_EPOLL.items():
            if flags & flag:
                mask |= bit
        if fd in self._registered:
            self._epoll.modify(fd, mask)
        else:
            self._epoll.register(fd, mask)
            self._registered.add(fd)

    def unregister(self, fd: int) -> None:
        self._registered.discard(fd)
        self._epoll.unregister(fd)

    def poll(self, timeout_ms: int) -> list[tuple[int, int]]:
        """``(fd, flags)`` of the ready descriptors; an error or a hang-up reads as readable (the
        read then finds the end)."""
        ready = []
        for fd, mask in self._epoll.poll(timeout_ms / 1000):
            flags = 0
            if mask & (select.EPOLLIN | select.EPOLLERR | select.EPOLLHUP):
                flags |= _POLLIN
            if mask & select.EPOLLOUT:
                flags |= _POLLOUT
            ready.append((fd, flags))
        return ready

    def close(self) -> None:
        self._epoll.close()


@dataclass(slots=True, eq=False)
class Connection:
    """One client's stream: what it sent that is not a whole message yet, and replies not sent."""

    sock: socket.socket
    identity: bytes
    pid: int
    inbox: bytearray = field(default_factory=bytearray)
    unsent: deque[memoryview] = field(default_factory=deque)
    unsent_bytes: int = 0
    #: Whether the loop waits for the socket to take more replies (``unsent`` is not empty).
    writing: bool = False
    #: Whether a whole message came (before one, the stream may turn out to be a ZeroMQ peer's).
    spoke: bool = False
    #: Who it is, for the server's log (made once: the loop names it every turn it reads).
    peer: str = field(init=False)

    def __post_init__(self) -> None:
        self.peer = f"unix pid {self.pid}"

    def fileno(self) -> int:
        return self.sock.fileno()


@dataclass(frozen=True, slots=True)
class Message:
    """A whole message: its body and tag (``None``: none sent)."""

    body: bytes
    tag: bytes | None


@dataclass(frozen=True, slots=True)
class Oversized:
    """A message larger than its sender may send (``size``: its body and tag)."""

    size: int


class UnixListener:
    """The listening socket at ``path`` and its connections, each registered with ``poller`` (the
    request loop's) for what the loop waits for on it; ``closed`` is told the identity of each
    connection that ends. Used by the request loop alone."""

    def __init__(
        self,
        path: Path,
        poller: zmq.Poller | EpollPoller,
        closed: Callable[[bytes], None] = lambda identity: None,
    ) -> None:
        self.path = path
        self._poller = poller
        self._closed = closed
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(path))
            os.chmod(path, 0o600)
            sock.listen(1024)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        poller.register(sock.fileno(), _POLLIN)
        self._ids = itertools.count(1)
        self._uid = os.geteuid()
        # Every read lands here first: a fresh buffer of READ_BYTES per recv() would be an
        # allocation (a mapping, at this size) per message.
        self._buffer = bytearray(READ_BYTES)
        self._view = memoryview(self._buffer)
        #: By identity, and by descriptor.
        self.connections: dict[bytes, Connection] = {}
        self.by_fd: dict[int, Connection] = {}
        #: Connections with whole messages not taken yet (:data:`MESSAGES_PER_TURN`).
        self.backlog: set[Connection] = set()
        #: Connections refused because another user's process opened them.
        self.refused = 0
        #: Connections closed because they opened with ZeroMQ's greeting, and the pids told so.
        self.zmq_peers = 0
        self._zmq_pids: set[int] = set()

    def fileno(self) -> int:
        return self._sock.fileno()

    def accept(self) -> None:
        """Take the connections waiting to be accepted, of this user (or root)."""
        while True:
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the rest wait in the listen backlog
                log.warning("cannot accept a connection on %s: %s", self.path, exc)
                return
            pid, uid = peer_credentials(sock)
            if uid not in (self._uid, 0):
                self.refused += 1
                log.warning(
                    "closed a connection to %s from pid %d of another user (uid %d)", self.path, pid, uid
                )
                sock.close()
                continue
            sock.setblocking(False)
            conn = Connection(sock, IDENTITY_PREFIX + next(self._ids).to_bytes(8, "big"), pid)
            self.connections[conn.identity] = conn
            self.by_fd[sock.fileno()] = conn
            self._poller.register(sock.fileno(), _POLLIN)

    def read(self, conn: Connection, limit: Callable[[bytes], int]) -> Iterator[Message | Oversized]:
        """The whole messages ``conn`` sent, reading at most :data:`READ_BYTES` of it. ``limit``:
        the most a message of that identity may hold (body and tag). An oversized one ends the
        connection (its closing is the caller's, after it answered)."""
        if conn in self.backlog:  # whole messages left from the last turn: those first
            self.backlog.discard(conn)
        else:
            try:
                got = conn.sock.recv_into(self._buffer)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                got = 0
            if not got:
                self.close(conn)
                return
            conn.inbox += self._view[:got]
        inbox = conn.inbox
        if not conn.spoke and speaks_zmtp(inbox):
            self._close_zmq_peer(conn)
            return
        at = taken = 0
        try:
            while (lengths := stream_lengths(inbox, at)) is not None:
                if taken == MESSAGES_PER_TURN:
                    self.backlog.add(conn)
                    return
                body_len, tag_len = lengths
                size = body_len + tag_len
                if size > limit(conn.identity):
                    yield Oversized(size)
                    return
                end = at + STREAM_HEADER.size + size
                if len(inbox) < end:
                    return
                body, tag = stream_parts(inbox, at, body_len, tag_len)
                at = end
                taken += 1
                conn.spoke = True
                yield Message(body, tag)
        finally:
            del inbox[:at]

    def _close_zmq_peer(self, conn: Connection) -> None:
        """Close ``conn``, whose process speaks ZeroMQ here: tell the operator the fix, once per process."""
        self.zmq_peers += 1
        if conn.pid not in self._zmq_pids:
            if len(self._zmq_pids) >= _ZMQ_PIDS_REMEMBERED:
                self._zmq_pids.clear()
            self._zmq_pids.add(conn.pid)
            log.warning(
                "closed a connection to %s from pid %d: it speaks ZeroMQ (a client given ipc://%s), and this "
                "server listens on unix://%s; point that client at unix://%s",
                self.path,
                conn.pid,
                self.path,
                self.path,
                self.path,
            )
        self.close(conn)

    def send(self, identity: bytes, body: bytes, tag: bytes | None) -> bool:
        """Queue a reply to the connection ``identity`` and send what the socket takes now; False
        if that connection is gone (or was just closed for not reading its replies)."""
        conn = self.connections.get(identity)
        if conn is None:
            return False
        pieces = stream_pieces(body, tag)
        conn.unsent.extend(memoryview(piece) for piece in pieces)
        conn.unsent_bytes += sum(len(piece) for piece in pieces)
        if conn.unsent_bytes > MAX_UNSENT_BYTES:
            log.warning(
                "closed %s: %d bytes of replies unread (a client that stopped reading)",
                conn.peer,
                conn.unsent_bytes,
            )
            self.close(conn)
            return False
        self.flush(conn)
        return True

    def flush(self, conn: Connection) -> None:
        """Send what the socket takes of ``conn``'s queued replies; the loop waits to send the rest."""
        unsent = conn.unsent
        while unsent:
            try:
                sent = conn.sock.send(unsent[0])
            except (BlockingIOError, InterruptedError):
                if not conn.writing:
                    conn.writing = True
                    self._poller.register(conn.fileno(), _POLLIN | _POLLOUT)
                return
            except OSError as exc:
                if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
                    log.debug("reply to %s dropped: %s", conn.peer, exc)
                self.close(conn)
                return
            conn.unsent_bytes -= sent
            if sent == len(unsent[0]):
                unsent.popleft()
            else:
                unsent[0] = unsent[0][sent:]
        if conn.writing:
            conn.writing = False
            self._poller.register(conn.fileno(), _POLLIN)

    def close(self, conn: Connection) -> None:
        """Close ``conn`` and say so (the server drops its session: nobody can speak for it again)."""
        if self.connections.pop(conn.identity, None) is not None:
            fd = conn.fileno()
            self.by_fd.pop(fd, None)
            self._poller.unregister(fd)  # before the descriptor's number can be reused
            self.backlog.discard(conn)
            conn.sock.close()
            conn.unsent.clear()
            self._closed(conn.identity)

    def close_all(self) -> None:
        """Close every connection and the listening socket, and remove the socket file."""
        for conn in list(self.connections.values()):
            self.close(conn)
        self._poller.unregister(self._sock.fileno())
        self._sock.close()
        self.path.unlink(missing_ok=True)


__all__ = ["IDENTITY_PREFIX", "Connection", "EpollPoller", "Message", "Oversized", "UnixListener"]
