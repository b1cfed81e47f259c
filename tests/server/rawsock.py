"""A bare DEALER socket for sending arbitrary bytes to a server (what a buggy client would do)."""

from __future__ import annotations

import msgspec
import zmq

from tiercache.wire import protocol as p


class RawSocket:
    def __init__(self, endpoint: str) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(endpoint)
        self.codec = p.Codec()

    def send_frames(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def request(self, frame: bytes | p._Msg, timeout_s: float = 10.0) -> p._Msg | None:
        """Send one frame and return the decoded reply, or None if the server dropped it."""
        raw = frame if isinstance(frame, bytes) else self.codec.encode(frame)
        self.sock.send(raw)
        return self.receive(timeout_s)

    def receive(self, timeout_s: float = 10.0) -> p._Msg | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return msgspec.msgpack.decode(self.sock.recv(), type=p.Reply)

    def hello(self) -> None:
        reply = self.request(p.Hello(protocol_version=p.PROTOCOL_VERSION))
        assert isinstance(reply, p.HelloReply)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
