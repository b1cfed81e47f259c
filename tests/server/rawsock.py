"""A bare DEALER socket for sending arbitrary bytes to a server (what a buggy client would do)."""

from __future__ import annotations

import itertools
import time

import msgspec
import zmq

from tiercache.wire import protocol as p
from tiercache.wire.codec import Codec

#: Request ids of this socket's own hellos and pings: far above what the fuzzers' pings use
#: (0..2**32), so a fuzzed frame's reply is never taken for the answer to one of ours.
OWN_REQ_IDS = 2**62 + 1_000_003


class RawSocket:
    def __init__(self, endpoint: str) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(endpoint)
        self.codec = Codec()
        self._own_ids = itertools.count(OWN_REQ_IDS)

    def send_frames(self, frames: list[bytes | memoryview]) -> None:
        self.sock.send_multipart(frames)

    def request(self, frame: bytes | p.Message, timeout_s: float = 10.0) -> p.Message | None:
        """Send one frame and return the decoded reply, or None if none came within ``timeout_s``
        (for a frame that must be answered: a frame that may get no reply is :meth:`probe`'s)."""
        raw = frame if isinstance(frame, bytes) else self.codec.encode(frame)
        self.sock.send(raw)
        return self.receive(timeout_s)

    def receive(self, timeout_s: float = 10.0) -> p.Message | None:
        """The next reply, decoded as a :data:`~tiercache.wire.protocol.Reply` (anything else raises),
        or None if none came within ``timeout_s``."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return msgspec.msgpack.decode(self.sock.recv(), type=p.Reply)

    def _answer_to(self, req_id: int, timeout_s: float) -> tuple[p.Message, list[p.Message]]:
        """Receive until the reply to ``req_id``; return it and the replies that came before it."""
        before: list[p.Message] = []
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self.receive(max(0.0, deadline - time.monotonic()))
            if reply is None:
                raise AssertionError(f"no answer to request {req_id} within {timeout_s} s (got {before})")
            if reply.req_id == req_id:
                return reply, before
            before.append(reply)

    def hello(self) -> list[p.Message]:
        """Say hello; return the replies to earlier frames that came before the hello's."""
        req_id = next(self._own_ids)
        self.sock.send(self.codec.encode(p.Hello(req_id=req_id, protocol_version=p.PROTOCOL_VERSION)))
        reply, before = self._answer_to(req_id, 10.0)
        assert isinstance(reply, p.HelloReply), reply
        return before

    def probe(self, frame: bytes, timeout_s: float = 10.0) -> tuple[list[p.Message], p.Message]:
        """Send ``frame`` (which may get a reply or none), then a ping; return the replies that came
        before the ping's answer, and that answer.

        The server reads one connection's frames in order and answers those it handles on its loop
        in order, so a reply to ``frame`` from the loop comes before the ping's answer; one from its
        I/O executor may come later, among the replies before a later hello or probe. A frame that
        gets no reply costs one round trip, not a timeout; a server that stopped answering fails
        after ``timeout_s``."""
        req_id = next(self._own_ids)
        self.sock.send(frame)
        self.sock.send(self.codec.encode(p.Ping(req_id=req_id)))
        answer, before = self._answer_to(req_id, timeout_s)
        return before, answer

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
