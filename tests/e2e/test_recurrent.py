"""A recurrent-state hybrid (tiny Qwen3-Next, and tiny Qwen3.5: layer 0 Gated DeltaNet linear
attention, layer 1 full attention) on a real vLLM CPU engine in ``mamba_cache_mode="align"``, end to end through a real
tiercache server.

vLLM unifies the block size to N = 384 tokens and keeps two KV-cache groups: a ``MambaSpec`` group
(one state page per block, position-indexed, mostly null) and a full-attention group. The connector
registers them as a ``GroupKind.RECURRENT`` and a ``GroupKind.FULL_ATTENTION`` object group; the
server's chunk is N. A recurrent object is the state *after* its chunk, so a hit of ``b`` chunks needs
every full-attention chunk before ``b`` and the state object of chunk ``b - 1`` only.

Prefill steps are ``max_num_batched_tokens`` = 768 tokens (two blocks) and vLLM retains state
checkpoints every 768 tokens (``prefix_cache_retention_interval``), so it keeps the state only at 768
and 1536 and hands those blocks to the connector: prompts of 1000, 1000, 1600 and 1600 tokens store
12 full-attention objects and 6 state objects, and a fresh engine may load 768, 768, 1536 and 1536
tokens (restorable boundaries 2 and 4; the states at 384 and 1152 never
existed, which the rule copes with). Two engine runs per model (a cold one and a fresh one), to keep
the cost near a minute per model on two cores.

Qwen3.5 (``Qwen3_5ForCausalLM``) is the same layout without MoE; vLLM's Qwen3.5 module imports
torchvision (through transformers' Qwen2-VL image processor), absent from the CPU venv, so its engines
run with an import-only torchvision stub from the test's temp dir on their PYTHONPATH.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.e2e.engine_run import (
    write_tiny_qwen3_5,
    write_tiny_qwen3_next,
    write_torchvision_stub,
)
from tests.e2e.objects import chunk_index, stored_objects
from tests.e2e.setup import (
    ModelWriter,
    Setup,
    cold_setup,
    engine_stats,
    wait_for_stores,
)
from tiercache.keys import GroupKind, ObjectKey

pytestmark = pytest.mark.e2e

CHUNK = 384  # vLLM's unified block size N for this model
STEP = 768  # prefill step (max_num_batched_tokens): recurrent state exists every STEP tokens
LENGTHS = [1000, 1000, 1600, 1600]
FULL_OBJECTS = sum(n // CHUNK for n in LENGTHS)  # 12
STATE_OBJECTS = sum(n // STEP for n in LENGTHS)  # 6
ENGINE_ARGS = {
    "dtype": "bfloat16",  # the CPU GDN kernels need it
    "mamba_cache_mode": "align",
    "block_size": 128,  # vLLM aligns N to it: 128 * ceil(state page / 128 tokens of KV) = 384
    "max_model_len": 2048,
    "max_num_batched_tokens": STEP,
    "max_num_seqs": 4,
    # vLLM's default (0) keeps only "semantic" state checkpoints (the latest replay boundary of each
    # request); a periodic interval also keeps the state every STEP tokens, so it can be stored.
    "prefix_cache_retention_interval": STEP,
}
# vLLM's multiprocess mode (scheduler and worker in separate processes, as ``vllm serve`` runs) costs
# ~50 s more per engine on two cores; it passes too, but CI's budget runs the fresh engine in-process.
MULTIPROCESS = os.environ.get("TIERCACHE_E2E_MULTIPROCESS", "0") == "1"


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    name = request.param
    tmp = tmp_path_factory.mktemp(f"e2e-{name}")
    write_model: ModelWriter = write_tiny_qwen3_next
    extra_path: Path | None = None
    if name == "qwen3_5":  # vLLM's Qwen3.5 module imports torchvision, absent from the CPU venv
        write_model, extra_path = write_tiny_qwen3_5, write_torchvision_stub(tmp / "stub")
    with cold_setup(tmp, write_model, LENGTHS, chunk=CHUNK, name=name, engine_args=ENGINE_ARGS, extra_path=extra_path) as s:
        yield s


def _state_objects(setup: Setup) -> dict[tuple[int, int], ObjectKey]:
    """(prompt, chunk) → key of the state object stored after that chunk."""
    index = chunk_index(setup.prompt_ids, CHUNK)
    return {index[k.prefix_hash]: k for k, kind in stored_objects(setup.server).items() if kind is GroupKind.RECURRENT}


def test_cold_run_stores_attention_chunks_and_states_at_step_boundaries(setup: Setup) -> None:
    assert setup.cold.num_cached == [0] * len(LENGTHS)
    total = FULL_OBJECTS + STATE_OBJECTS
    stores = wait_for_stores(setup.server, total)
    index = chunk_index(setup.prompt_ids, CHUNK)
    assert stores == total, str(sorted((kind.value, index[k.prefix_hash]) for k, kind in stored_objects(setup.server).items()))
    kinds = list(stored_objects(setup.server).values())
    assert kinds.count(GroupKind.FULL_ATTENTION) == FULL_OBJECTS
    # The state after chunk c exists only where a prefill step ended: 768 and 1536 tokens.
    assert sorted(_state_objects(setup)) == [(0, 1), (1, 1), (2, 1), (2, 3), (3, 1), (3, 3)]


def test_fresh_engine_restores_states_and_the_controls_fail(setup: Setup) -> None:
    """One fresh engine (in-process, or multiprocess with ``TIERCACHE_E2E_MULTIPROCESS=1``), after
    two objects were tampered with:

    * prompts 0 and 3 are intact: they load 768 and 1536 tokens (every attention chunk before the
      boundary, the state after the last one) and reproduce the cold run exactly;
    * prompt 1 (negative control): its state object at 768 is replaced by prompt 0's (a foreign
      state of the same size); it loads it and its logprobs move far beyond the tolerance, so the
      restored state is really written and matters;
    * prompt 2: its state object at 1536 is deleted; every attention chunk is still there, but the
      longest restorable boundary is 768, whose state exists, and that shorter hit still
      reproduces the cold run exactly.

    (A load that fails in the worker is not exercised here: vLLM 0.32 refuses block-level load
    errors for models with several KV-cache groups and stops the engine; see docs/vllm.md.)
    """
    wait_for_stores(setup.server, FULL_OBJECTS + STATE_OBJECTS)
    states = _state_objects(setup)
    with setup.server.client() as c:
        foreign = c.get(states[(0, 1)])
        assert foreign is not None
        assert c.delete(states[(1, 1)])
        assert c.put(states[(1, 1)], foreign)
        assert c.delete(states[(2, 3)])
    hits_before = engine_stats(setup.server)["lookup_chunks_hit"]
    run = setup.run("warm", multiprocess=MULTIPROCESS)
    hits = engine_stats(setup.server)["lookup_chunks_hit"] - hits_before
    diff = [max(abs(a - b) for a, b in zip(w, c)) for w, c in zip(run.logprobs, setup.cold.logprobs)]
    mode = "multiprocess" if MULTIPROCESS else "in-process"
    print(f"\n[e2e {setup.name} gdn+full, {mode}] cached tokens {run.num_cached} (server chunk hits "
          f"{hits}); max |logprob diff|: intact {diff[0]:.3g} and {diff[3]:.3g}, foreign state "
          f"{diff[1]:.3g}, last state deleted {diff[2]:.3g}")
    assert run.num_cached == [768, 768, 768, 1536]
    assert run.tokens[0] == setup.cold.tokens[0] and diff[0] <= 1e-5
    assert run.tokens[3] == setup.cold.tokens[3] and diff[3] <= 1e-5
    assert diff[1] > 1e-2
    assert run.tokens[2] == setup.cold.tokens[2] and diff[2] <= 1e-5
