"""A sliding-window hybrid (tiny Gemma 3: layer 0 sliding window 64, layer 1 full attention) on a real
vLLM CPU engine, end to end through a real tiercache server.

vLLM puts the two layers into two KV-cache groups (``SlidingWindowSpec``, ``FullAttentionSpec``) whose
tensors alias one storage. The connector registers them as two object groups, the sliding one as
``GroupKind.SLIDING_WINDOW`` with a window of 64 tokens = 1 chunk of 64: a hit of ``b`` chunks needs
every chunk of the full group and only chunk ``b - 1`` of the sliding group.

Prompt lengths 200, 257 and 200 give 3 + 4 + 3 = 10 stored chunks, 20 objects; a fresh engine may load
3, 4 and 3 chunks (192, 256 and 192 tokens). One fresh engine carries the hit and its negative
control: the last prompt's in-window sliding object is noise while it runs (prompts are generated
one at a time, so the noisy prompt cannot move the others).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

pytest.importorskip("vllm")

from tests.e2e.engine_run import write_tiny_gemma3
from tests.e2e.objects import chunk_index, stored_objects
from tests.e2e.setup import Run, Setup, cold_setup, wait_for_stores
from tiercache.keys import GroupKind, ObjectKey

pytestmark = pytest.mark.e2e

CHUNK = 64
LENGTHS = [200, 257, 200]
EXPECTED_CACHED = [((n - 1) // CHUNK) * CHUNK for n in LENGTHS]  # [192, 256, 192]
STORED_CHUNKS = sum(n // CHUNK for n in LENGTHS)  # 10
NOISY = 2  # the prompt whose in-window sliding object is noise for the fresh engine
INTACT = [p for p in range(len(LENGTHS)) if p != NOISY]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    with cold_setup(tmp_path_factory.mktemp("e2e-gemma3"), write_tiny_gemma3, LENGTHS, chunk=CHUNK) as s:
        yield s


def _in_window(setup: Setup, key: ObjectKey, index: dict[bytes, tuple[int, int]]) -> bool:
    """Whether a fresh engine's hit needs this sliding-group object (the last hit chunk)."""
    p, c = index[key.prefix_hash]
    return c == EXPECTED_CACHED[p] // CHUNK - 1


def test_cold_run_stores_both_groups(setup: Setup) -> None:
    assert setup.cold.num_cached == [0] * len(LENGTHS)
    assert wait_for_stores(setup.server, 2 * STORED_CHUNKS) == 2 * STORED_CHUNKS
    kinds = list(stored_objects(setup.server).values())
    assert kinds.count(GroupKind.SLIDING_WINDOW) == STORED_CHUNKS
    assert kinds.count(GroupKind.FULL_ATTENTION) == STORED_CHUNKS


@dataclass(frozen=True)
class Fresh:
    """The fresh engine's run and what was done to the stored objects before it ran."""

    run: Run
    hits: int
    removed: int  # sliding-group objects outside the hits' windows, deleted
    noised: int  # in-window sliding-group objects of prompt NOISY, overwritten with noise


@pytest.fixture(scope="module")
def fresh(setup: Setup) -> Fresh:
    """Delete every sliding-group object outside the hits' windows and overwrite the in-window one of
    prompt :data:`NOISY` with noise of the same size, then run one fresh engine."""
    wait_for_stores(setup.server, 2 * STORED_CHUNKS)
    index = chunk_index(setup.prompt_ids, CHUNK)
    removed, noised = 0, 0
    rng = np.random.default_rng(0)
    with setup.server.client() as c:
        for key, kind in stored_objects(setup.server).items():
            if kind is not GroupKind.SLIDING_WINDOW:
                continue
            if not _in_window(setup, key, index):
                assert c.delete(key)
                removed += 1
            elif index[key.prefix_hash][0] == NOISY:
                data = c.get(key)
                assert data is not None
                c.delete(key)
                assert c.put(key, rng.standard_normal(len(data) // 4).astype(np.float32).tobytes())
                noised += 1
    run, hits = setup.run_counting_hits("warm")
    return Fresh(run, hits, removed, noised)


def _diff(run: Run, cold: Run, prompts: list[int]) -> float:
    """The largest |logprob difference| of ``run`` and ``cold`` over ``prompts``."""
    return max(abs(a - b) for p in prompts for a, b in zip(run.logprobs[p], cold.logprobs[p]))


def test_hit_needs_only_the_trailing_window_chunk_of_the_sliding_group(setup: Setup, fresh: Fresh) -> None:
    """With every sliding-group object outside the hits' windows deleted, a fresh engine still hits
    the whole prefix (full group: every chunk; sliding group: the last chunk) and matches the cold
    run on the intact prompts."""
    # 7: chunks 0-1 of prompts 0 and 2, 0-2 of prompt 1
    assert fresh.removed == STORED_CHUNKS - len(LENGTHS)
    warm = fresh.run
    diff = _diff(warm, setup.cold, INTACT)
    print(
        f"\n[e2e gemma3 sliding+full] cached tokens {warm.num_cached} (server chunk hits {fresh.hits}), "
        f"max |logprob diff| {diff:.3g} over prompts {INTACT}"
    )
    assert warm.num_cached == EXPECTED_CACHED
    assert [warm.tokens[p] for p in INTACT] == [setup.cold.tokens[p] for p in INTACT]
    assert diff <= 1e-5


def test_noise_in_the_sliding_window_chunk_changes_the_output(setup: Setup, fresh: Fresh) -> None:
    """Negative control: prompt :data:`NOISY`'s in-window sliding-group object (the only one of its
    sliding objects a hit loads) was noise; the fresh engine loaded it and that prompt's logprobs
    moved far beyond the tolerance (the sliding layer's KV matters and is really written)."""
    assert fresh.noised == 1
    diff = _diff(fresh.run, setup.cold, [NOISY])
    print(
        f"\n[e2e gemma3 corrupt sliding] cached tokens {fresh.run.num_cached[NOISY]}, "
        f"max |logprob diff| {diff:.3g}"
    )
    assert fresh.run.num_cached[NOISY] == EXPECTED_CACHED[NOISY]
    assert diff > 1e-2
