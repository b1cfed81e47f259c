"""Gemma 4 (KV-cache groups with *different* block sizes) and gpt-oss (sliding window + sinks, MoE) on
a real vLLM CPU engine, end to end through a real tiercache server.

Tiny seeded-weight checkpoints (``engine_run.TINY_GEMMA4`` / ``TINY_GPT_OSS``), chunk 64, window 64:

* Gemma 4: vLLM gives the sliding group (head 32) 64-token blocks and the full group (head 64)
  32-token blocks, so one chunk is 1 sliding block and 2 full blocks: the connector maps each group
  with its own block size.
* gpt-oss: both groups use 32-token blocks (2 per chunk); vLLM puts the window on layer 0.

Per model, two engines (each a fresh process): a cold run stores three prompts; then, before one
fresh engine runs, noise replaces prompt B's sliding-group object and prompt C's full-group object
that its hit loads. Prompt A must hit and reproduce the cold run; B and C must hit and differ far
beyond the tolerance (negative controls: each group's loaded KV is really placed and read).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import pytest

pytest.importorskip("vllm")

from tests.e2e.engine_run import TINY_GEMMA4, TINY_GPT_OSS
from tests.e2e.objects import stored_manifests
from tests.e2e.setup import Run, Setup, cold_setup
from tests.server.serverproc import ServerProcess
from tiercache.keys import ExtraKeys, GroupKind, ObjectKey, PrefixHasher
from tiercache.testing.checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.e2e

CHUNK = 64
LENGTHS = [200, 150, 180]  # A: clean, B: noise in a sliding object, C: noise in a full object
CLEAN, NOISY_SLIDING, NOISY_FULL = 0, 1, 2
EXPECTED_CACHED = [((n - 1) // CHUNK) * CHUNK for n in LENGTHS]  # [192, 128, 128]
STORED_CHUNKS = sum(n // CHUNK for n in LENGTHS)  # 3 + 2 + 2 = 7 per group

MODELS = {
    # name: (config, block size per group kind)
    "gemma4": (TINY_GEMMA4, {GroupKind.SLIDING_WINDOW: 64, GroupKind.FULL_ATTENTION: 32}),
    "gpt-oss": (TINY_GPT_OSS, {GroupKind.SLIDING_WINDOW: 32, GroupKind.FULL_ATTENTION: 32}),
}


@dataclass(kw_only=True)
class ModelSetup(Setup):
    """The cold run of one model, and a fresh engine's run after two objects got noise."""

    block_sizes: dict[GroupKind, int]
    warm: Run
    stored: dict[ObjectKey, GroupKind]  # after the cold run
    object_bytes: dict[GroupKind, int]
    group_block_sizes: dict[GroupKind, int]  # from the manifests the engine registered
    chunk_hits: int  # server lookup hits of the fresh engine
    corrupted: dict[int, ObjectKey] = field(default_factory=dict)


def _stored(server: ServerProcess) -> tuple[dict[ObjectKey, GroupKind], dict[GroupKind, int]]:
    """Every stored object with its group kind, and each kind's block size from its manifest."""
    manifests = stored_manifests(server)
    return (
        {key: m.group_kind for key, m in manifests.items()},
        {m.group_kind: m.kernel_block_size for m in manifests.values()},
    )


def _last_hit_chunk_key(
    stored: dict[ObjectKey, GroupKind], prompt: list[int], hit_tokens: int, kind: GroupKind
) -> ObjectKey:
    """The object of group ``kind`` for the last chunk a fresh engine's hit loads for ``prompt``
    (with window 64 = 1 chunk, the only sliding object that hit needs)."""
    last = PrefixHasher(CHUNK, ExtraKeys()).update(prompt)[hit_tokens // CHUNK - 1]
    [key] = [k for k, g in stored.items() if g is kind and k.prefix_hash == last]
    return key


@pytest.fixture(scope="module", params=list(MODELS), ids=list(MODELS))
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelSetup]:
    name: str = request.param
    cfg, block_sizes = MODELS[name]
    with cold_setup(
        tmp_path_factory.mktemp(f"e2e-{name}"),
        partial(write_tiny_checkpoint, cfg=cfg),
        LENGTHS,
        chunk=CHUNK,
        name=name,
        prompt_seed=11,
        wait_for_stored=2 * STORED_CHUNKS,
        # Whole chunks: this module specifies the chunk rules of these layouts (Gemma 4's groups of
        # different block sizes get no tails anyway); tails on a sliding layout: test_tails.py.
        connector_config={"tails": False},
    ) as base:
        stored, group_blocks = _stored(base.server)
        rng = np.random.default_rng(0)
        corrupted: dict[int, ObjectKey] = {}
        object_bytes: dict[GroupKind, int] = {}
        with base.server.client() as c:
            for key, kind in stored.items():
                data = c.get(key)
                assert data is not None
                object_bytes[kind] = len(data)
            for prompt, kind in (
                (NOISY_SLIDING, GroupKind.SLIDING_WINDOW),
                (NOISY_FULL, GroupKind.FULL_ATTENTION),
            ):
                key = _last_hit_chunk_key(stored, base.prompt_ids[prompt], EXPECTED_CACHED[prompt], kind)
                size = object_bytes[kind]
                c.delete(key)
                assert c.put(key, rng.standard_normal(size // 4).astype(np.float32).tobytes())
                corrupted[prompt] = key
        warm, hits = base.run_counting_hits("warm")
        yield ModelSetup.of(
            base,
            block_sizes=block_sizes,
            warm=warm,
            stored=stored,
            object_bytes=object_bytes,
            group_block_sizes=group_blocks,
            chunk_hits=hits,
            corrupted=corrupted,
        )


def test_cold_run_stores_every_chunk_of_both_groups_with_their_block_sizes(setup: ModelSetup) -> None:
    assert setup.cold.num_cached == [0] * len(LENGTHS)
    kinds = list(setup.stored.values())
    assert kinds.count(GroupKind.SLIDING_WINDOW) == STORED_CHUNKS
    assert kinds.count(GroupKind.FULL_ATTENTION) == STORED_CHUNKS
    assert setup.group_block_sizes == setup.block_sizes
    # Both groups' pages are the same size (vLLM unifies them), so an object is proportional to
    # its group's blocks per chunk: Gemma 4's full object holds twice the sliding one's blocks.
    per_chunk = {kind: CHUNK // bs for kind, bs in setup.block_sizes.items()}
    sliding, full = GroupKind.SLIDING_WINDOW, GroupKind.FULL_ATTENTION
    assert setup.object_bytes[full] * per_chunk[sliding] == setup.object_bytes[sliding] * per_chunk[full]


def test_fresh_engine_loads_and_matches_the_cold_run(setup: ModelSetup) -> None:
    warm, cold = setup.warm, setup.cold
    diff = max(abs(a - b) for a, b in zip(warm.logprobs[CLEAN], cold.logprobs[CLEAN]))
    print(
        f"\n[e2e {setup.name}] cached tokens {warm.num_cached} (server chunk hits {setup.chunk_hits}), "
        f"clean prompt max |logprob diff| {diff:.3g}"
    )
    assert warm.num_cached == EXPECTED_CACHED  # every prompt hit, the noisy ones too
    assert setup.chunk_hits == sum(EXPECTED_CACHED) // CHUNK
    assert warm.tokens[CLEAN] == cold.tokens[CLEAN]
    assert diff <= 1e-5


@pytest.mark.parametrize("prompt", [NOISY_SLIDING, NOISY_FULL], ids=["sliding-group", "full-group"])
def test_noise_in_one_loaded_object_changes_the_output(setup: ModelSetup, prompt: int) -> None:
    """Negative control: the fresh engine loaded the noisy object (the hit is whole) and its
    logprobs for that prompt move far beyond the tolerance the clean prompt meets."""
    diff = max(abs(a - b) for a, b in zip(setup.warm.logprobs[prompt], setup.cold.logprobs[prompt]))
    print(
        f"\n[e2e {setup.name} noise in {setup.stored[setup.corrupted[prompt]].value}] "
        f"cached tokens {setup.warm.num_cached[prompt]}, max |logprob diff| {diff:.3g}"
    )
    assert setup.warm.num_cached[prompt] == EXPECTED_CACHED[prompt]
    assert diff > 1e-2
