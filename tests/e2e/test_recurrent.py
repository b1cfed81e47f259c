"""Recurrent-state hybrids on a real vLLM CPU engine in ``mamba_cache_mode="align"``, end to end
through a real tiercache server: tiny Qwen3-Next and Qwen3.5 (layer 0 Gated DeltaNet linear
attention, layer 1 full attention) and a tiny IBM Granite 4 hybrid (layer 0 Mamba2, layer 1 full
attention).

vLLM unifies the block size to N = 384 tokens for all three (the tiny configs are sized for it) and
keeps two KV-cache groups: a ``MambaSpec`` group (one state page per block, position-indexed, mostly
null) and a full-attention group. The connector registers them as a ``GroupKind.RECURRENT`` and a
``GroupKind.FULL_ATTENTION`` object group; the server's chunk is N. A recurrent object is the state
*after* its chunk, so a hit of ``b`` chunks needs every full-attention chunk before ``b`` and the
state object of chunk ``b - 1`` only.

The state exists only where a prefill step ended, every ``step`` = ``max_num_batched_tokens`` tokens,
and vLLM retains it there (``prefix_cache_retention_interval`` = ``step``) and hands those blocks to
the connector. The step is per model:

* Gated DeltaNet: 768 (two blocks), so prompts of 1000, 1000, 1600 and 1600 tokens store 12
  full-attention objects and 6 state objects (at 768 and 1536; the states at 384 and 1152 never
  existed, which the restore rule copes with), and a fresh engine may load 768, 768, 1536 and 1536;
* Mamba2 (Granite 4): 384 = N, because vLLM's CPU Mamba2 path cannot take a prefill step with a
  block boundary inside it: the Mamba2 layer saves a mid-step state checkpoint at such a boundary
  (``num_prefill_checkpoint_blocks=1``), asking the chunk scan for intermediate states, and the CPU
  scan returns only the final ones (``IndexError`` in ``mamba_mixer2.conv_ssm_forward`` with a
  768-token step). With step N the same prompts store 12 + 12 objects (a state at every block end).

Two engine runs per model (a cold one and a fresh one), to keep the cost near a minute per model on
two cores.

Qwen3.5 (``Qwen3_5ForCausalLM``) is the same layout as Qwen3-Next without MoE, and tiercache sees no
difference at all: with vLLM 0.32.0 the manifests of both object groups (recurrent and full
attention: dtypes, backend, state shapes and dtypes, page sizes, block sizes, layer names, spec) are
identical but for the model's own identity (``model_id``, ``model_revision``). So CI runs Qwen3-Next
and Granite 4 only; ``TIERCACHE_E2E_QWEN3_5=1`` adds Qwen3.5 (after a vLLM upgrade, or to check a
figure of docs/hybrid-models.md). vLLM's Qwen3.5 module imports torchvision (through transformers'
Qwen2-VL image processor), absent from the CPU venv, so its engines run with an import-only
torchvision stub from the test's temp dir on their PYTHONPATH.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.e2e.engine_run import (
    write_tiny_granite4,
    write_tiny_qwen3_5,
    write_tiny_qwen3_next,
    write_torchvision_stub,
)
from tests.e2e.objects import chunk_index, stored_objects
from tests.e2e.setup import (
    ModelWriter,
    Setup,
    cold_setup,
    wait_for_stores,
)
from tiercache.keys import GroupKind, ObjectKey

pytestmark = pytest.mark.e2e

LENGTHS = [1000, 1000, 1600, 1600]
INTACT, FOREIGN_STATE, LAST_STATE_DELETED, INTACT_LONG = range(4)


@dataclass(frozen=True)
class Recurrent:
    """One recurrent hybrid under test and the settings its layout dictates."""

    write: ModelWriter
    layers: str  # for the printed line
    chunk: int  # vLLM's unified block size N for this model (= the server's chunk)
    step: int  # prefill step (max_num_batched_tokens): recurrent state exists every ``step`` tokens
    dtype: str
    torchvision_stub: bool = False  # vLLM's module imports torchvision, absent from the CPU venv
    # vLLM's CPU build keeps the GDN SSM state in float32 where the CPU has AVX-512 BF16, and in the
    # model dtype elsewhere, which halves the state page and so N (384 → 256). Pinned, so the layout
    # (and every expectation below) is the same on every CPU.
    ssm_cache_dtype: str | None = None

    def engine_args(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "mamba_cache_mode": "align",
            "block_size": 128,  # vLLM aligns N to it: 128 * ceil(state page / 128 tokens of KV) = 384
            "max_model_len": 2048,
            "max_num_batched_tokens": self.step,
            "max_num_seqs": 4,
            # vLLM's default (0) keeps only "semantic" state checkpoints (the latest replay boundary of
            # each request); a periodic interval also keeps the state every step, so it can be stored.
            "prefix_cache_retention_interval": self.step,
            **({"mamba_ssm_cache_dtype": self.ssm_cache_dtype} if self.ssm_cache_dtype else {}),
        }

    @property
    def full_objects(self) -> int:
        return sum(n // self.chunk for n in LENGTHS)

    def state_chunks(self, n: int) -> list[int]:
        """The chunks of an ``n``-token prompt after which the cold run had a state: every step end."""
        return [k * self.step // self.chunk - 1 for k in range(1, n // self.step + 1)]

    @property
    def state_objects(self) -> int:
        return sum(len(self.state_chunks(n)) for n in LENGTHS)

    def hit_chunk(self, n: int) -> int:
        """The last chunk of the longest hit of an ``n``-token prompt: the last step end."""
        return self.state_chunks(n)[-1]

    def expected_cached(self) -> list[int]:
        """What a fresh engine loads per prompt: up to the last state; for the prompt whose last state
        was deleted, up to the state before it."""
        ends = [(c + 1) * self.chunk for c in (self.hit_chunk(n) for n in LENGTHS)]
        ends[LAST_STATE_DELETED] = (self.state_chunks(LENGTHS[LAST_STATE_DELETED])[-2] + 1) * self.chunk
        return ends


MODELS = {
    "qwen3_next": Recurrent(  # the CPU GDN kernels need bf16
        write_tiny_qwen3_next, "gdn+full", chunk=384, step=768, dtype="bfloat16", ssm_cache_dtype="float32"
    ),
    "qwen3_5": Recurrent(
        write_tiny_qwen3_5,
        "gdn+full",
        chunk=384,
        step=768,
        dtype="bfloat16",
        torchvision_stub=True,
        ssm_cache_dtype="float32",
    ),
    "granite4": Recurrent(write_tiny_granite4, "mamba2+full", chunk=384, step=384, dtype="float32"),
}
# Qwen3.5's layout is Qwen3-Next's as tiercache sees it (see the module docstring): opt-in.
if os.environ.get("TIERCACHE_E2E_QWEN3_5", "0") != "1":
    del MODELS["qwen3_5"]
# vLLM's multiprocess mode (scheduler and worker in separate processes, as ``vllm serve`` runs) costs
# ~50 s more per engine on two cores; it passes too, but CI's budget runs the fresh engine in-process.
MULTIPROCESS = os.environ.get("TIERCACHE_E2E_MULTIPROCESS", "0") == "1"


@dataclass(kw_only=True)
class RecurrentSetup(Setup):
    spec: Recurrent


@pytest.fixture(scope="module", params=list(MODELS), ids=list(MODELS))
def setup(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RecurrentSetup]:
    name: str = request.param
    spec = MODELS[name]
    tmp = tmp_path_factory.mktemp(f"e2e-{name}")
    extra_path = write_torchvision_stub(tmp / "stub") if spec.torchvision_stub else None
    with cold_setup(
        tmp,
        spec.write,
        LENGTHS,
        chunk=spec.chunk,
        name=name,
        engine_args=spec.engine_args(),
        extra_path=extra_path,
    ) as base:
        yield RecurrentSetup.of(base, spec=spec)


def _state_objects(setup: RecurrentSetup) -> dict[tuple[int, int], ObjectKey]:
    """(prompt, chunk) → key of the state object stored after that chunk."""
    index = chunk_index(setup.prompt_ids, setup.spec.chunk)
    return {
        index[k.prefix_hash]: k
        for k, kind in stored_objects(setup.server).items()
        if kind is GroupKind.RECURRENT
    }


def test_cold_run_stores_attention_chunks_and_states_at_step_boundaries(setup: RecurrentSetup) -> None:
    spec = setup.spec
    assert setup.cold.num_cached == [0] * len(LENGTHS)
    total = spec.full_objects + spec.state_objects  # 12 + 6 (step 768), 12 + 12 (step 384)
    stores = wait_for_stores(setup.server, total)
    index = chunk_index(setup.prompt_ids, spec.chunk)
    assert stores == total, str(
        sorted((kind.value, index[k.prefix_hash]) for k, kind in stored_objects(setup.server).items())
    )
    kinds = list(stored_objects(setup.server).values())
    assert kinds.count(GroupKind.FULL_ATTENTION) == spec.full_objects
    # The state after chunk c exists only where a prefill step ended (step 768: at 768 and 1536 tokens).
    assert sorted(_state_objects(setup)) == [
        (p, c) for p, n in enumerate(LENGTHS) for c in spec.state_chunks(n)
    ]


def test_fresh_engine_restores_states_and_the_controls_fail(setup: RecurrentSetup) -> None:
    """One fresh engine (in-process, or multiprocess with ``TIERCACHE_E2E_MULTIPROCESS=1``), after
    two objects were tampered with:

    * prompts 0 and 3 are intact: they load up to their last state (768 and 1536 tokens: every
      attention chunk before the boundary, the state after the last one) and reproduce the cold run
      exactly;
    * prompt 1 (negative control): its state object at 768 is replaced by prompt 0's (a foreign
      state of the same size); it loads it and its logprobs move far beyond the tolerance, so the
      restored state is really written and matters;
    * prompt 2: its state object at 1536 is deleted; every attention chunk is still there, but the
      longest restorable boundary is the previous state (768 with step 768, 1152 with step 384),
      and that shorter hit still reproduces the cold run exactly.

    (A load that fails in the worker is not exercised here: vLLM 0.32 refuses block-level load
    errors for models with several KV-cache groups and stops the engine; see docs/vllm.md.)
    """
    spec = setup.spec
    wait_for_stores(setup.server, spec.full_objects + spec.state_objects)
    states = _state_objects(setup)
    with setup.server.client() as c:
        foreign = c.get(states[(INTACT, spec.hit_chunk(LENGTHS[INTACT]))])
        assert foreign is not None
        target = (FOREIGN_STATE, spec.hit_chunk(LENGTHS[FOREIGN_STATE]))
        assert c.delete(states[target])
        assert c.put(states[target], foreign)
        assert c.delete(states[(LAST_STATE_DELETED, spec.hit_chunk(LENGTHS[LAST_STATE_DELETED]))])
    run, hits = setup.run_counting_hits("warm", multiprocess=MULTIPROCESS)
    diff = [max(abs(a - b) for a, b in zip(w, c)) for w, c in zip(run.logprobs, setup.cold.logprobs)]
    mode = "multiprocess" if MULTIPROCESS else "in-process"
    print(
        f"\n[e2e {setup.name} {spec.layers}, step {spec.step}, {mode}] cached tokens {run.num_cached} "
        f"(server chunk hits {hits}); max |logprob diff|: intact {diff[INTACT]:.3g} and {diff[INTACT_LONG]:.3g}, "
        f"foreign state {diff[FOREIGN_STATE]:.3g}, last state deleted {diff[LAST_STATE_DELETED]:.3g}"
    )
    assert (
        run.num_cached == spec.expected_cached()
    )  # step 768: [768, 768, 768, 1536]; 384: [768, 768, 1152, 1536]
    for p in (INTACT, INTACT_LONG, LAST_STATE_DELETED):
        assert run.tokens[p] == setup.cold.tokens[p] and diff[p] <= 1e-5, p
    assert diff[FOREIGN_STATE] > 1e-2
