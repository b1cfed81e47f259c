"""Frames verify themselves: any damage or any other key is an error, never a payload."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import make_key
from tiercache.errors import FrameError, FrameVersionError
from tiercache.frames import HEADER_BYTES, decode_frame, encode_frame

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
