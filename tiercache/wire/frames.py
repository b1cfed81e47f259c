"""How a request is laid out in ZeroMQ frames, so the server can bound what any frame costs it.

libzmq buffers a whole frame before the server's loop sees it, so the largest frame the server
takes bounds what a peer without a session can make it hold (``ZMQ_MAXMSGSIZE``: a larger frame
closes the connection before its bytes are buffered). A request body over
:data:`REQUEST_FRAME_BYTES` therefore travels in several frames of at most that size, and a request
of more than one frame ends with a trailer: the session's tag (:mod:`tiercache.wire.auth`), or an
empty frame on a session without one. A single frame is a body without a tag. The server reads the
frames one by one and joins them up to its ``max_message_bytes``, dropping the rest of a message it
will not take as it arrives.
"""

from __future__ import annotations

from collections.abc import Sequence

#: The largest request frame: a request body larger than this is split. Every request but a
#: socket ``put`` (tools, remote clients) fits one: a full request of 16,384 keys is ~0.8 MiB.
REQUEST_FRAME_BYTES = 1 << 20


def request_frames(body: bytes, tag: bytes | None) -> list[bytes | memoryview]:
    """The frames that carry ``body`` (and its ``tag``, on a signed session) to the server."""
    if tag is None and len(body) <= REQUEST_FRAME_BYTES:
        return [body]
    view = memoryview(body)
    parts: list[bytes | memoryview] = [
        view[at : at + REQUEST_FRAME_BYTES] for at in range(0, len(body), REQUEST_FRAME_BYTES)
    ] or [b""]
    parts.append(b"" if tag is None else tag)
    return parts


def request_of(frames: Sequence[bytes | memoryview]) -> tuple[bytes, bytes | None]:
    """The body and the tag (``None``: none sent) of a request received as ``frames`` (at least one)."""
    if len(frames) == 1:
        return bytes(frames[0]), None
    body = b"".join(frames[:-1])
    tag = bytes(frames[-1])
    return body, (tag or None)
