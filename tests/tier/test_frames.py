"""Frames verify themselves: any damage or any other key is an error, never a payload."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import make_key
from tiercache.errors import FrameError, FrameVersionError
from tiercache.tier.frames import (
    HEADER_BYTES,
    FrameHeader,
    decode_frame,
    encode_frame,
    encode_header,
    pack_payload,
    plain_header_fields,
)

KEY = make_key(1)


@pytest.mark.parametrize("compress", [False, True])
@given(payload=st.binary(max_size=2000))
def test_round_trip(compress: bool, payload: bytes) -> None:
    assert bytes(decode_frame(KEY, encode_frame(KEY, payload, compress=compress))) == payload


def test_compression_is_used_when_it_helps() -> None:
    payload = b"\x00" * 100_000
    assert len(encode_frame(KEY, payload, compress=True)) < len(payload) // 10


@given(payload=st.binary(min_size=1, max_size=500), data=st.data())
def test_any_single_bit_flip_is_detected(payload: bytes, data: st.DataObject) -> None:
    frame = bytearray(encode_frame(KEY, payload))
    bit = data.draw(st.integers(min_value=0, max_value=len(frame) * 8 - 1))
    frame[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(FrameError):
        decode_frame(KEY, frame)


@given(payload=st.binary(min_size=1, max_size=500), data=st.data())
def test_any_truncation_is_detected(payload: bytes, data: st.DataObject) -> None:
    frame = encode_frame(KEY, payload)
    cut = data.draw(st.integers(min_value=0, max_value=len(frame) - 1))
    with pytest.raises(FrameError):
        decode_frame(KEY, frame[:cut])


def test_a_frame_of_another_key_is_rejected() -> None:
    with pytest.raises(FrameError, match="another key"):
        decode_frame(make_key(2), encode_frame(KEY, b"payload"))


def test_an_unknown_format_version_is_rejected() -> None:
    import struct

    import xxhash

    frame = bytearray(encode_frame(KEY, b"payload"))
    frame[4] = 99
    body_len = HEADER_BYTES - 8
    frame[body_len:HEADER_BYTES] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(frame[:body_len])))
    with pytest.raises(FrameVersionError):
        decode_frame(KEY, frame)


def test_encode_header_writes_the_same_bytes_as_frame_header_encode() -> None:
    header, _stored = pack_payload(KEY, b"x" * 1000, compress=True)
    assert (
        encode_header(KEY.to_bytes(), header.flags, header.payload_len, header.stored_len, header.checksum)
        == header.encode()
    )


def test_the_fast_header_check_accepts_an_intact_plain_header_of_the_key_asked_for() -> None:
    header, _stored = pack_payload(KEY, b"payload bytes")
    assert plain_header_fields(header.encode(), KEY.to_bytes()) == (
        header.payload_len,
        header.checksum,
    )
    assert plain_header_fields(header.encode(), make_key(2).to_bytes()) is None


def test_the_fast_header_check_leaves_compressed_frames_to_the_full_decode() -> None:
    header, _stored = pack_payload(KEY, bytes(10_000), compress=True)
    assert header.flags  # really compressed
    assert plain_header_fields(header.encode(), KEY.to_bytes()) is None
    assert FrameHeader.decode(header.encode(), KEY) == header


@pytest.mark.parametrize("bit", range(HEADER_BYTES * 8))
def test_the_fast_header_check_rejects_every_header_the_full_decode_rejects(bit: int) -> None:
    raw = bytearray(encode_frame(KEY, b"some payload")[:HEADER_BYTES])
    raw[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(FrameError):
        FrameHeader.decode(bytes(raw), KEY)
    assert plain_header_fields(bytes(raw), KEY.to_bytes()) is None
