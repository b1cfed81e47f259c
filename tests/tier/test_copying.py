"""Copies between buffers (:func:`tiercache.tier.copying.copy_into`): the tiers' copies of an
object's bytes, taken with the GIL released when large."""

from __future__ import annotations

import mmap
import os

import pytest

from tiercache.tier.copying import copy_into


@pytest.mark.parametrize("nbytes", [0, 1, 64 * 1024 - 1, 64 * 1024, 3 * 1024 * 1024 + 5])
def test_a_copy_lands_byte_for_byte_whatever_its_size(nbytes: int) -> None:
    src = os.urandom(nbytes)
    dst = bytearray(nbytes)
    copy_into(dst, src)
    assert bytes(dst) == src


def test_a_copy_lands_in_shared_memory_as_in_an_arena_slot() -> None:
    src = os.urandom(1 << 20)
    with mmap.mmap(-1, 2 << 20) as shared:
        copy_into(memoryview(shared)[4096 : 4096 + len(src)], src)
        assert shared[4096 : 4096 + len(src)] == src
        assert shared[:4096] == bytes(4096)  # nothing outside the destination is touched


@pytest.mark.parametrize("nbytes", [16, 1 << 20])
def test_lengths_that_differ_are_refused_and_nothing_is_written(nbytes: int) -> None:
    dst = bytearray(nbytes)
    with pytest.raises(ValueError, match="size mismatch"):
        copy_into(dst, os.urandom(nbytes + 1))
    assert dst == bytearray(nbytes)


@pytest.mark.parametrize("nbytes", [16, 1 << 20])
def test_a_read_only_destination_is_refused(nbytes: int) -> None:
    with pytest.raises((TypeError, ValueError)):
        copy_into(bytes(nbytes), os.urandom(nbytes))
