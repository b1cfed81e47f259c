"""The ``unix://`` stream: how a message is laid out on a Unix stream socket, without libzmq, and who
is at the other end of one.

Each message, request or reply, is a :data:`STREAM_HEADER` (its body's and its tag's lengths), then
the body, then the tag (none: length 0): the server knows a message's size before it reads a byte
of its body. The bodies and tags are the ones ZeroMQ endpoints carry (:mod:`tiercache.wire.frames`).
"""

from __future__ import annotations

import socket
import struct

#: The scheme of an endpoint served without libzmq (``unix:///path/to/socket``).
UNIX_SCHEME = "unix://"

#: A message's header: the body's and the tag's lengths, u32 big-endian.
STREAM_HEADER = struct.Struct(">II")

#: Bodies up to this size are sent joined to their header (:func:`stream_pieces`).
JOIN_BYTES = 64 * 1024

#: What a ZeroMQ peer sends first on any connection (ZMTP 3's signature: ``0xFF``, 8 bytes, ``0x7F``).
#: A stream header never starts with ``0xFF``: that is the top byte of a body of 4 GiB or more.
ZMTP_SIGNATURE = b"\xff" + bytes(8) + b"\x7f"

_PEER_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def stream_message(body: bytes | memoryview, tag: bytes | None) -> list[bytes | memoryview]:
    """The pieces that carry ``body`` (and its ``tag``) on a ``unix://`` stream, in order."""
    header = STREAM_HEADER.pack(len(body), 0 if tag is None else len(tag))
    return [header, body] if not tag else [header, body, tag]


def stream_pieces(body: bytes, tag: bytes | None) -> list[bytes | memoryview]:
    """:func:`stream_message`'s pieces as they are sent: a body of at most :data:`JOIN_BYTES`
    joined to its header and tag in one piece (one send, not one per piece); a larger one not
    copied."""
    pieces = stream_message(body, tag)
    return [b"".join(pieces)] if len(body) <= JOIN_BYTES else pieces


def speaks_zmtp(buffer: bytes | bytearray) -> bool:
    """Whether a connection whose first bytes are ``buffer`` is from a ZeroMQ peer (an ``ipc://``
    endpoint at the other end), not a ``unix://`` one."""
    return buffer[:1] == ZMTP_SIGNATURE[:1]


def stream_lengths(buffer: bytearray, at: int = 0) -> tuple[int, int] | None:
    """The body's and tag's lengths of the message whose header starts at ``at`` in ``buffer``, or
    ``None`` while that header is not all there."""
    if len(buffer) - at < STREAM_HEADER.size:
        return None
    body_len: int
    tag_len: int
    body_len, tag_len = STREAM_HEADER.unpack_from(buffer, at)
    return body_len, tag_len


def stream_parts(buffer: bytearray, at: int, body_len: int, tag_len: int) -> tuple[bytes, bytes | None]:
    """The body and tag (``None``: none) of the whole message at ``at`` in ``buffer``, each copied
    once; the buffer may be resized once this returns."""
    start = at + STREAM_HEADER.size
    with memoryview(buffer) as view:  # released here: a bytearray with a view cannot shrink
        body = bytes(view[start : start + body_len])
        tag = bytes(view[start + body_len : start + body_len + tag_len]) if tag_len else None
    return body, tag


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of Unix socket ``sock``, as the kernel
    says (``SO_PEERCRED``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER_CREDENTIALS.size)
    pid, uid, _gid = _PEER_CREDENTIALS.unpack(raw)
    return pid, uid
