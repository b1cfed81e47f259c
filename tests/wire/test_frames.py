"""Specification: a request's frames carry its body (split at 1 MiB) and its tag, and give both back."""

from __future__ import annotations

import os

import pytest

from tiercache.wire.frames import REQUEST_FRAME_BYTES, request_frames, request_of

SIZES = [
    0,
    1,
    REQUEST_FRAME_BYTES - 1,
    REQUEST_FRAME_BYTES,
    REQUEST_FRAME_BYTES + 1,
    3 * REQUEST_FRAME_BYTES + 17,
]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("tag", [None, b"t" * 24], ids=["untagged", "tagged"])
def test_a_body_and_its_tag_come_back_from_its_frames(size: int, tag: bytes | None) -> None:
    body = os.urandom(size)
    frames = request_frames(body, tag)
    assert all(len(f) <= REQUEST_FRAME_BYTES for f in frames)
    assert request_of(frames) == (body, tag)


def test_a_small_untagged_body_is_one_frame_and_anything_else_ends_with_a_trailer() -> None:
    assert request_frames(b"ping", None) == [b"ping"]
    assert request_frames(b"ping", b"tag") == [b"ping", b"tag"]
    big = request_frames(b"x" * (2 * REQUEST_FRAME_BYTES + 1), None)
    assert [len(f) for f in big] == [REQUEST_FRAME_BYTES, REQUEST_FRAME_BYTES, 1, 0]
