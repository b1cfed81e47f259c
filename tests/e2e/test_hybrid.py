"""A sliding-window hybrid (tiny Gemma 3: layer 0 sliding window 64, layer 1 full attention) on a real
vLLM CPU engine, end to end through a real tiercache server.

vLLM puts the two layers into two KV-cache groups (``SlidingWindowSpec``, ``FullAttentionSpec``) whose
tensors alias one storage. The connector registers them as two object groups, the sliding one as
``GroupKind.SLIDING_WINDOW`` with a window of 64 tokens = 1 chunk of 64: a hit of ``b`` chunks needs
every chunk of the full group and only chunk ``b - 1`` of the sliding group.

Prompt lengths 200 and 257 give 3 + 4 = 7 stored chunks, 14 objects; a fresh engine may load 3 and 4
chunks (192 and 256 tokens).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("vllm")

from tests.e2e.engine_run import write_tiny_gemma3
from tests.e2e.objects import chunk_index, stored_objects
from tests.e2e.setup import Setup, cold_setup, wait_for_stores
from tiercache.keys import GroupKind, ObjectKey

pytestmark = pytest.mark.e2e

CHUNK = 64
LENGTHS = [200, 257]
EXPECTED_CACHED = [((n - 1) // CHUNK) * CHUNK for n in LENGTHS]  # [192, 256]
STORED_CHUNKS = sum(n // CHUNK for n in LENGTHS)  # 7


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    with cold_setup(tmp_path_factory.mktemp("e2e-gemma3"), write_tiny_gemma3, LENGTHS, chunk=CHUNK) as s:
        yield s


def _in_window(setup: Setup, key: ObjectKey, index: dict[bytes, tuple[int, int]]) -> bool:
    """Whether a fresh engine's hit needs this sliding-group object (the last hit chunk)."""
    p, c = index[key.prefix_hash]
    return c == EXPECTED_CACHED[p] // CHUNK - 1


def test_cold_run_stores_both_groups(setup: Setup) -> None:
    assert setup.cold.num_cached == [0, 0]
    assert wait_for_stores(setup.server, 2 * STORED_CHUNKS) == 2 * STORED_CHUNKS
    kinds = list(stored_objects(setup.server).values())
    assert kinds.count(GroupKind.SLIDING_WINDOW) == STORED_CHUNKS
    assert kinds.count(GroupKind.FULL_ATTENTION) == STORED_CHUNKS


def test_hit_needs_only_the_trailing_window_chunk_of_the_sliding_group(setup: Setup) -> None:
    """Delete every sliding-group object outside the hits' windows: a fresh engine still hits the
    whole prefix (full group: every chunk; sliding group: the last chunk) and matches the cold run."""
    wait_for_stores(setup.server, 2 * STORED_CHUNKS)
    index = chunk_index(setup.prompt_ids, CHUNK)
    removed = {}
    with setup.server.client() as c:
        for key, kind in stored_objects(setup.server).items():
            if kind is GroupKind.SLIDING_WINDOW and not _in_window(setup, key, index):
                removed[key] = c.get(key)
                assert c.delete(key)
    assert len(removed) == STORED_CHUNKS - len(LENGTHS)  # 5: chunks 0-1 of prompt 0, 0-2 of prompt 1
    warm, hits = setup.run_counting_hits("warm")
    diff = warm.max_logprob_diff(setup.cold)
    print(
        f"\n[e2e gemma3 sliding+full] cached tokens {warm.num_cached} (server chunk hits {hits}), "
        f"max |logprob diff| {diff:.3g}"
    )
    assert warm.num_cached == EXPECTED_CACHED
    assert warm.tokens == setup.cold.tokens
    assert diff <= 1e-5


def test_noise_in_the_sliding_window_chunk_changes_the_output(setup: Setup) -> None:
    """Negative control: overwrite only the sliding-group objects a hit loads with noise; the fresh
    engine loads them and its logprobs move far beyond the tolerance (the sliding layer's KV matters
    and is really written)."""
    wait_for_stores(setup.server, 2 * STORED_CHUNKS)
    index = chunk_index(setup.prompt_ids, CHUNK)
    originals: dict[ObjectKey, bytes] = {}
    rng = np.random.default_rng(0)
    with setup.server.client() as c:
        for key, kind in stored_objects(setup.server).items():
            if kind is GroupKind.SLIDING_WINDOW and _in_window(setup, key, index):
                data = c.get(key)
                assert data is not None
                originals[key] = data
                c.delete(key)
                assert c.put(key, rng.standard_normal(len(data) // 4).astype(np.float32).tobytes())
    assert len(originals) == len(LENGTHS)
    bad = setup.run("corrupt")
    diff = bad.max_logprob_diff(setup.cold)
    print(f"\n[e2e gemma3 corrupt sliding] cached tokens {bad.num_cached}, max |logprob diff| {diff:.3g}")
    assert bad.num_cached == EXPECTED_CACHED
    assert diff > 1e-2
