"""Encoding and decoding of the protocol's messages (:mod:`tiercache.wire.protocol`), and the
diagnosis of a request that does not decode."""

from __future__ import annotations

import msgspec

from tiercache.wire import protocol as p


class Codec:
    """Encoders/decoders for one side. Not thread-safe (msgspec's are reused); one per thread."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.requests = msgspec.msgpack.Decoder(p.Request)
        self.replies = msgspec.msgpack.Decoder(p.Reply)
        self._any = msgspec.msgpack.Decoder()

    def encode(self, msg: p.Message) -> bytes:
        return self.encoder.encode(msg)

    def classify_bad_request(self, frame: bytes) -> tuple[int, p.ErrorCode, str]:
        """For a frame that did not decode as a request: its ``req_id`` if any, and why it failed."""
        try:
            raw = self._any.decode(frame)
        except msgspec.DecodeError as exc:
            return 0, p.ErrorCode.MALFORMED, f"not a msgpack message: {exc}"
        except RecursionError:
            return 0, p.ErrorCode.MALFORMED, "a msgpack message nested too deeply to decode"
        if not isinstance(raw, dict):
            return 0, p.ErrorCode.MALFORMED, "a request must be a msgpack map with an 'op' field"
        req_id = raw.get("req_id", 0)
        if not isinstance(req_id, int) or isinstance(req_id, bool) or not 0 <= req_id < 2**63:
            req_id = 0
        op = raw.get("op")
        if not isinstance(op, str):
            return req_id, p.ErrorCode.MALFORMED, "a request needs a string 'op' field"
        if op not in p.REQUEST_OPS:
            return (
                req_id,
                p.ErrorCode.UNKNOWN_OP,
                (
                    f"unknown op {op[:64]!r} for protocol version {p.PROTOCOL_VERSION}; "
                    f"known: {', '.join(sorted(p.REQUEST_OPS))}"
                ),
            )
        try:
            self.requests.decode(frame)
        except msgspec.ValidationError as exc:
            return req_id, p.ErrorCode.MALFORMED, f"bad {op!r} request: {exc}"
        except (msgspec.DecodeError, RecursionError):
            return req_id, p.ErrorCode.MALFORMED, f"bad {op!r} request: nested too deeply or undecodable"
        return req_id, p.ErrorCode.MALFORMED, f"bad {op!r} request"
