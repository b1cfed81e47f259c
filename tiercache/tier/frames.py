"""Self-verifying object frames: how every chunk is stored on L2 and L3.

A frame is a fixed 75-byte header followed by the stored payload::

    magic "TCKV" | format u8 | flags u8 | reserved u16 | object key (35 bytes)
    | payload length u64 | stored length u64 | xxh3-64 of stored payload u64 | xxh3-64 of the above u64

Everything little-endian. ``flags`` bit 0 means the stored payload is zstd-compressed; ``payload
length`` is the length after decompression. The header carries its own checksum so a flipped bit in
any header field is caught too.

:func:`verify` checks a frame against the key the caller *asked for*. Any mismatch — wrong magic,
unknown version, another key, truncated payload, wrong checksum, corrupt compression — raises
:class:`~tiercache.errors.FrameError`; tiers turn that into a counted miss plus a deletion, never a hit.

L2 keeps the header and the payload in two LMDB records so that the payload can be written straight
from an L1 slot without first being copied behind a header; L3 stores ``header + payload`` as one S3
object. The bytes of the header are identical in both places.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import xxhash

from tiercache.errors import FrameError, FrameVersionError, IntegrityError
from tiercache.keys.digest import digest
from tiercache.keys.object_key import KEY_BYTES, ObjectKey

MAGIC = b"TCKV"
FRAME_VERSION = 1
_BODY = struct.Struct(f"<4sBBH{KEY_BYTES}sQQQ")
_CHECK = struct.Struct("<Q")
HEADER_BYTES = _BODY.size + _CHECK.size


class FrameFlags(enum.IntFlag):
    """Bits of the frame's flags byte."""

    NONE = 0
    ZSTD = 1


#: ``FrameFlags.ZSTD`` as a plain int, for the read path (enum arithmetic costs ~1 µs per read).
ZSTD_FLAG = int(FrameFlags.ZSTD)
_ZSTD = ZSTD_FLAG


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """The parsed, checked header of one frame."""

    key: ObjectKey
    flags: int  # FrameFlags bits; a plain int because this is parsed on every read
    payload_len: int
    stored_len: int
    checksum: int

    def encode(self) -> bytes:
        """The 75-byte header, its own checksum included."""
        return encode_header(
            self.key.to_bytes(), int(self.flags), self.payload_len, self.stored_len, self.checksum
        )

    @classmethod
    def decode(cls, raw: bytes | memoryview, expected_key: ObjectKey) -> FrameHeader:
        """Parse and check a header against the key the caller asked for."""
        if len(raw) < HEADER_BYTES:
            raise FrameError(f"frame header truncated: {len(raw)} of {HEADER_BYTES} bytes")
        body = bytes(raw[: _BODY.size])
        (check,) = _CHECK.unpack_from(raw, _BODY.size)
        magic, version, flags, _reserved, key_raw, payload_len, stored_len, checksum = _BODY.unpack(body)
        if magic != MAGIC:
            raise FrameError(f"bad frame magic {magic!r}")
        if xxhash.xxh3_64_intdigest(body) != check:
            raise FrameError("frame header checksum mismatch")
        if version != FRAME_VERSION:
            raise FrameVersionError(
                f"frame format {version} is not supported by this build (reads {FRAME_VERSION})"
            )
        if flags & ~_ZSTD:
            raise FrameVersionError(f"unknown frame flags {flags:#x}")
        if key_raw != expected_key.to_bytes():
            raise FrameError("frame belongs to another key")
        return cls(expected_key, flags, payload_len, stored_len, checksum)


def encode_header(
    key_raw: bytes, flags: int, payload_len: int, stored_len: int, payload_checksum: int
) -> bytes:
    """The 75-byte header from its fields (``key_raw`` is ``ObjectKey.to_bytes()``).

    What :meth:`FrameHeader.encode` returns, without building a :class:`FrameHeader` first: the L2
    put path calls this once per object.
    """
    body = _BODY.pack(MAGIC, FRAME_VERSION, flags, 0, key_raw, payload_len, stored_len, payload_checksum)
    return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))


def plain_header_fields(raw: bytes | memoryview, expected_key_raw: bytes) -> tuple[int, int] | None:
    """``(payload length, payload checksum)`` of an intact header of an *uncompressed* frame of
    ``expected_key_raw``; ``None`` for anything else (compressed, damaged, foreign, truncated).

    The read paths' fast check: it accepts exactly the headers that :meth:`FrameHeader.decode`
    accepts with flags 0 and ``payload_len == stored_len``. On ``None``, call
    :meth:`FrameHeader.decode` for the general case and the reason.
    """
    if len(raw) < HEADER_BYTES:
        return None
    magic, version, flags, _reserved, key_raw, payload_len, stored_len, payload_checksum = _BODY.unpack_from(
        raw
    )
    if (
        magic != MAGIC
        or version != FRAME_VERSION
        or flags
        or key_raw != expected_key_raw
        or payload_len != stored_len
        or xxhash.xxh3_64_intdigest(raw[: _BODY.size]) != _CHECK.unpack_from(raw, _BODY.size)[0]
    ):
        return None
    return payload_len, payload_checksum


#: xxh3-64 of ``data``: the payload checksum frames carry, which for an uncompressed frame is the
#: object's payload digest (:mod:`tiercache.keys.digest`).
checksum = digest


def build_header(
    key: ObjectKey, stored: bytes | bytearray | memoryview, payload_len: int, flags: FrameFlags
) -> FrameHeader:
    """The header for ``stored`` (already compressed when ``flags`` says so)."""
    return FrameHeader(key, flags, payload_len, len(stored), checksum(stored))


def pack_payload(
    key: ObjectKey, payload: bytes | bytearray | memoryview, *, compress: bool = False, level: int = 1
) -> tuple[FrameHeader, bytes | bytearray | memoryview]:
    """Return ``(header, stored)``: the payload compressed if asked (and if that makes it smaller)."""
    if compress:
        import zstandard

        packed = zstandard.ZstdCompressor(level=level).compress(payload)
        if len(packed) < len(payload):
            return build_header(key, packed, len(payload), FrameFlags.ZSTD), packed
    return build_header(key, payload, len(payload), FrameFlags.NONE), payload


def encode_frame(
    key: ObjectKey,
    payload: bytes | bytearray | memoryview,
    *,
    compress: bool = False,
    digest: int | None = None,
) -> bytes:
    """``header + stored payload`` as one bytes object (the L3 object body).

    ``digest``: what ``payload`` must hash to (its writer's digest, for a payload in memory others
    may write): the frame carries it, and the body, once built, is checked against it
    (:class:`~tiercache.errors.IntegrityError` if the payload changed under the copy)."""
    if digest is not None and compress:
        payload = bytes(payload)  # compress a private copy known to be the writer's
        check_copy(payload, digest, key, "write_through")
        digest = None
    if digest is None:
        header, stored = pack_payload(key, payload, compress=compress)
        return b"".join((header.encode(), stored))  # one copy of the payload, not two
    size = memoryview(payload).nbytes
    body = b"".join((encode_header(key.to_bytes(), 0, size, size, digest), payload))
    check_copy(memoryview(body)[HEADER_BYTES:], digest, key, "write_through")
    return body


def check_copy(copy: bytes | bytearray | memoryview, digest: int | None, key: ObjectKey, path: str) -> None:
    """Raise :class:`IntegrityError` (caught at ``path``) if ``copy``, a copy a tier made of bytes
    others could write (an L1 slot), does not hash to ``digest`` (``None``: nothing to check)."""
    if digest is not None and checksum(copy) != digest:
        raise IntegrityError(
            f"the bytes of {key} changed while they were copied (they differ from the digest its "
            "writer committed): another process wrote into its L1 slot; nothing was stored",
            path,
        )


def verify_payload(header: FrameHeader, stored: bytes | bytearray | memoryview) -> bytes | memoryview:
    """Check ``stored`` against ``header``; return the payload (decompressed if needed)."""
    if len(stored) != header.stored_len:
        raise FrameError(f"payload truncated: {len(stored)} of {header.stored_len} bytes")
    if checksum(stored) != header.checksum:
        raise FrameError("payload checksum mismatch")
    if header.flags & _ZSTD:
        import zstandard

        try:
            out = zstandard.ZstdDecompressor().decompress(stored, max_output_size=header.payload_len)
        except zstandard.ZstdError as exc:
            raise FrameError(f"compressed payload does not decode: {exc}") from exc
        if len(out) != header.payload_len:
            raise FrameError("decompressed payload has the wrong length")
        return out
    if header.payload_len != header.stored_len:
        raise FrameError("uncompressed payload length disagrees with the stored length")
    return stored if isinstance(stored, memoryview) else memoryview(stored)


def decode_frame(expected_key: ObjectKey, blob: bytes | bytearray | memoryview) -> bytes | memoryview:
    """Verify a whole frame (header + payload) against ``expected_key``; return the payload."""
    view = memoryview(blob)
    header = FrameHeader.decode(view[:HEADER_BYTES], expected_key)
    return verify_payload(header, view[HEADER_BYTES:])
