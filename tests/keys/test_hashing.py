"""Chained chunk hashes identify a token prefix, and nothing else."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiercache.errors import ConfigError
from tiercache.keys import ExtraKeys, PrefixHasher, chunk_hashes

C = 4
tokens_st = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=40)


def test_only_full_chunks_are_hashed() -> None:
    assert len(chunk_hashes(list(range(11)), C)) == 2
    assert chunk_hashes(list(range(3)), C) == []


def test_each_hash_is_16_bytes_and_depends_on_every_earlier_token() -> None:
    base = list(range(12))
    changed = base.copy()
    changed[0] = 999
    a, b = chunk_hashes(base, C), chunk_hashes(changed, C)
    assert all(len(h) == 16 for h in a)
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_a_change_in_a_later_chunk_keeps_earlier_hashes() -> None:
    base = list(range(12))
    changed = base.copy()
    changed[9] = 999
    a, b = chunk_hashes(base, C), chunk_hashes(changed, C)
    assert a[:2] == b[:2]
    assert a[2] != b[2]


@pytest.mark.parametrize(
    "other",
    [ExtraKeys(cache_salt="tenant-b"), ExtraKeys(lora_name="adapter"), ExtraKeys(mm_hashes=("img",))],
)
def test_extra_keys_separate_tenants_adapters_and_media(other: ExtraKeys) -> None:
    tokens = list(range(8))
    assert chunk_hashes(tokens, C, ExtraKeys(cache_salt="tenant-a")) != chunk_hashes(tokens, C, other)
    assert chunk_hashes(tokens, C) != chunk_hashes(tokens, C, other)


def test_extra_key_fields_cannot_be_shifted_into_each_other() -> None:
    a = ExtraKeys(cache_salt="ab", lora_name="")
    b = ExtraKeys(cache_salt="a", lora_name="b")
    assert a.seed() != b.seed()


@given(tokens_st)
def test_lists_and_arrays_hash_the_same(tokens: list[int]) -> None:
    assert chunk_hashes(tokens, C) == chunk_hashes(np.array(tokens, dtype=np.uint32), C)


@given(tokens_st, st.lists(st.integers(min_value=1, max_value=9), max_size=6))
def test_incremental_hashing_equals_hashing_all_at_once(tokens: list[int], steps: list[int]) -> None:
    hasher = PrefixHasher(C)
    seen = 0
    for step in steps:
        seen = min(len(tokens), seen + step)
        hasher.update(tokens[:seen])
    assert hasher.update(tokens) == chunk_hashes(tokens, C)


def test_a_chunk_size_of_zero_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="chunk size"):
        PrefixHasher(0)


def test_token_ids_outside_uint32_are_rejected() -> None:
    with pytest.raises(ValueError, match="token ids"):
        chunk_hashes([0, 1, 2, -1], C)
    with pytest.raises(ValueError, match="token ids"):
        chunk_hashes(np.array([0, 1, 2, 2**40]), C)
