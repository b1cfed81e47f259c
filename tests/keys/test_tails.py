"""Tail hashes: the blocks past a prompt's last full chunk, chained like chunks but never one."""

from __future__ import annotations

import pytest

from tiercache.errors import ConfigError
from tiercache.keys import ExtraKeys, PrefixHasher, chunk_hashes, tail_hashes

TOKENS = list(range(1000, 1300))


def _hasher(tokens: list[int], chunk: int = 128, salt: str = "") -> PrefixHasher:
    h = PrefixHasher(chunk, ExtraKeys(cache_salt=salt))
    h.update(tokens)
    return h


def test_a_block_hash_names_every_token_up_to_its_end() -> None:
    h = _hasher(TOKENS)
    base = tail_hashes(h.before(2), TOKENS[256:300], 16)
    assert len(base) == 2  # 44 tokens: two full blocks of 16
    changed = [*TOKENS[:280], 7, *TOKENS[281:]]  # a token in block 1 of chunk 2
    again = tail_hashes(_hasher(changed).before(2), changed[256:300], 16)
    assert again[0] == base[0] and again[1] != base[1]
    earlier = [7, *TOKENS[1:]]  # a token in chunk 0: every tail after it differs
    assert not set(tail_hashes(_hasher(earlier).before(2), earlier[256:300], 16)) & set(base)


def test_the_chain_before_chunk_0_is_the_seed_so_the_salt_separates_tails() -> None:
    plain = tail_hashes(_hasher(TOKENS[:100]).before(0), TOKENS[:100], 32)
    salted = tail_hashes(_hasher(TOKENS[:100], salt="acme").before(0), TOKENS[:100], 32)
    assert len(plain) == 3 and not set(plain) & set(salted)


def test_a_tail_is_never_a_chunk_even_over_the_same_tokens() -> None:
    """A chunk of 16 tokens and a tail block of 16, after the same chain value, hash apart."""
    chunks = chunk_hashes(TOKENS[:32], 16)
    tails = tail_hashes(PrefixHasher(16).before(0), TOKENS[:32], 16)
    assert not set(chunks) & set(tails)


def test_before_refuses_a_chunk_not_hashed_yet() -> None:
    h = _hasher(TOKENS)  # 2 full chunks of 128
    assert h.before(2) == h.hashes[1]
    with pytest.raises(ValueError, match="past the 2 full chunks"):
        h.before(3)
    with pytest.raises(ConfigError):
        tail_hashes(h.before(0), TOKENS, 0)
