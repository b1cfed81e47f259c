"""Models whose vLLM 0.32 kernels run only on a GPU, end to end through a real tiercache server:
Kimi-Linear (KDA recurrent layers + MLA), DeepSeek-V4 (compressed and sliding MLA, hyper-connections),
GLM-5 (MLA with DeepSeek Sparse Attention) and MiniMax-M3 (GQA with a block-sparse indexer).

The same checks as the CPU models' modules (test_dense, test_hybrid, test_recurrent, test_restart),
four engine runs per model, every engine a fresh process:

1. a cold engine stores every full chunk of every prompt, in every object group the connector
   registered (one per vLLM KV-cache group: MLA, indexer, compressor, KDA state ...);
2. the server is stopped, one stored attention chunk (prompt 0, chunk 1) is corrupted inside the
   disk tier's LMDB file, and a *restarted* server (empty L1) serves a fresh engine: every hit comes
   from L2 (promotions), the corrupted chunk and the ones after it miss (prompt 0 loads 1 chunk, or
   none for models with several KV-cache groups, whose failed load vLLM recomputes whole; the other
   prompt all of its chunks), and the greedy tokens equal the cold run's with chosen-token
   logprobs within a score-level tolerance (bf16 on GPU: ``TIERCACHE_GPU_LOGPROB_TOL``, default 0.05);
3. negative control: every stored object's bytes are replaced by another object's of the same group
   (valid numbers, wrong KV / state); a fresh engine loads them and its logprobs move by more than
   10x the tolerance;
4. other weights (another seed, same config, same path layout): a different fingerprint, no hits, and
   really different outputs.

Weights: vLLM's dummy loader with every parameter overwritten from a seed by name
(``tests/e2e/seeded_dummy_run.py``), not a safetensors checkpoint: these models' checkpoint names
are remapped by vLLM (fused experts, MLA absorption, DeepSeek-V4's hyper-connections and FP4 expert
mapping), which no transformers class reproduces reliably. The values are drawn like
``write_tiny_checkpoint``'s (sharp attention, spread logits), so check 3 is as sensitive as on the CPU
models; only vLLM's own dummy values (U(-1e-3, 1e-3)) would have made it weak.

Chunk size: the connector requires a multiple of vLLM's block size N (unified for Kimi-Linear's KDA
+ MLA, backend-dependent for MLA). Each model starts with a guess (``chunk``); when the connector
refuses it at start-up ("... is not a multiple of the vLLM engine's block size N"), the fixture
reads N from that message and runs the cold engine again with chunk N (one extra engine start).

GPU-only: every test is skipped unless ``torch.cuda.is_available()`` in this (the engines') venv.
Run on a GPU box with the vLLM GPU build installed in the environment that runs pytest::

    python -m pytest tests/e2e/test_gpu_models.py -v -s -rs

The machinery itself (seeded dummy weights, N discovery, LMDB corruption, restart, rotation, other
weights) can be exercised without a GPU: ``TIERCACHE_GPU_E2E_CPU_STANDIN=1`` runs the same tests on
two CPU-runnable stand-ins instead (a dense Llama, and Qwen3-Next: Gated DeltaNet + full attention,
the recurrent path Kimi-Linear takes), with CPU engine settings; about 3 minutes on two cores.

Without a GPU (CI) one test still runs the harness's own parts, on the Llama stand-in with a single
engine (``test_the_harness_itself_on_a_cpu_stand_in``), so a broken harness is found before a GPU
run: N read from the connector's refusals, the cold phase through the seeded dummy weights (every
chunk in every group, sharp logits), the LMDB flip hitting exactly the probed object, and the
rotation giving every object another one's bytes.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.e2e.gpu_models import KIMI_LINEAR_N_GUESS, VOCAB, writer
from tests.e2e.objects import chunk_index, stored_manifests
from tests.e2e.seeded_dummy_run import weights_id
from tests.e2e.setup import MiB, Run, Setup, cold_setup, engine_stats, wait_for_stores
from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.connector.layout import check_block_sizes
from tiercache.errors import ConfigError
from tiercache.keys import GroupKind, ObjectKey


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


HAS_CUDA = _cuda_available()
CPU_STANDIN = not HAS_CUDA and os.environ.get("TIERCACHE_GPU_E2E_CPU_STANDIN", "0") == "1"
pytestmark = pytest.mark.e2e
#: The model tests: on a GPU, or on the CPU stand-ins when asked.
gpu_test = pytest.mark.skipif(
    not (HAS_CUDA or CPU_STANDIN),
    reason="needs a CUDA GPU: these models' vLLM kernels (KDA, MLA, DSA, "
    "sparse indexers) do not run on vLLM's CPU build; torch.cuda.is_available() is False",
)

SEEDED_DUMMY_RUN = "tests.e2e.seeded_dummy_run"
TOL = float(os.environ.get("TIERCACHE_GPU_LOGPROB_TOL", "0.05"))
CORRUPT_PROMPT, CORRUPT_CHUNK = 0, 1
N_PATTERNS = (
    re.compile(r"not a multiple of the vLLM engine's block size (\d+)"),
    re.compile(r"smaller than the block size (\d+)"),
    re.compile(r"Setting attention block size to (\d+) tokens"),
)


@dataclass(frozen=True)
class GpuModel:
    """One GPU-only architecture and the engine settings its kernels need."""

    arch: str
    chunk: int  # first guess of the server's chunk (a multiple of vLLM's block size N)
    block_size: int  # --block-size asked for (vLLM may raise it: MLA alignment, hybrid unification)
    recurrent: bool = False
    dtype: str = "bfloat16"
    cpu: bool = False  # a CPU stand-in (TIERCACHE_GPU_E2E_CPU_STANDIN): CPU engine settings
    # A connector refusal known from the CPU start (same KV-cache grouping code on GPU): when the cold
    # engine stops with this message, the model's tests xfail with it instead of erroring.
    known_refusal: str | None = None

    def lengths(self, chunk: int) -> list[int]:
        return [3 * chunk + 8, 4 * chunk + 1]

    def engine_args(self, chunk: int) -> dict[str, Any]:
        args: dict[str, Any] = {
            "load_format": "dummy",  # seeded_dummy_run overwrites the values from the seed
            "dtype": self.dtype,
            "distributed_executor_backend": "uni"
            if self.cpu
            else None,  # on GPU: vLLM's choice (uni for one GPU)
            "enforce_eager": True,
            **({} if self.cpu else {"gpu_memory_utilization": 0.3}),
            "kv_cache_memory_bytes": (64 if self.cpu else 1024) * MiB,
            "block_size": self.block_size,
            "max_model_len": 5 * chunk,
            "max_num_batched_tokens": 5 * chunk,
            "max_num_seqs": 4,
        }
        if self.recurrent:
            # The state exists only at prefill-step ends; step = chunk keeps one at every chunk end,
            # and the retention interval makes vLLM hand those blocks to the connector.
            args.update(
                mamba_cache_mode="align", max_num_batched_tokens=chunk, prefix_cache_retention_interval=chunk
            )
        return args


GPU_MODELS = {
    "kimi_linear": GpuModel(
        "KimiLinearForCausalLM", chunk=KIMI_LINEAR_N_GUESS, block_size=64, recurrent=True
    ),
    # On vLLM 0.32's CPU build this config builds, loads and allocates its KV cache: 6 groups, block
    # sizes (64, 64, 64, 256, 4, 8), group 0 a UniformTypeKVCacheSpecs, which the connector refuses.
    "deepseek_v4": GpuModel(
        "DeepseekV4ForCausalLM",
        chunk=256,
        block_size=256,
        known_refusal="KV-cache group 0 is UniformTypeKVCacheSpecs",
    ),
    "glm_moe_dsa": GpuModel("GlmMoeDsaForCausalLM", chunk=64, block_size=64),
    "minimax_m3": GpuModel("MiniMaxM3SparseForCausalLM", chunk=128, block_size=128),
}
CPU_STANDINS = {
    # First chunk guesses deliberately wrong (N is 32 and 384 there), so the discovery path runs too.
    "llama_cpu": GpuModel("LlamaForCausalLM", chunk=48, block_size=32, dtype="float32", cpu=True),
    "qwen3_next_cpu": GpuModel("Qwen3NextForCausalLM", chunk=256, block_size=128, recurrent=True, cpu=True),
}
MODELS = CPU_STANDINS if CPU_STANDIN else GPU_MODELS


@dataclass(kw_only=True)
class GpuSetup(Setup):
    """The cold run (server A, stopped since), the restarted server B (the module's ``server``) and
    the fresh engine that ran against it."""

    spec: GpuModel
    chunk: int
    lengths: list[int]
    cold_groups: dict[
        bytes, tuple[GroupKind, set[tuple[int, int]]]
    ]  # fingerprint -> kind, stored (prompt, chunk)
    corrupt_flipped: int  # copies of the probe flipped in data.mdb
    restart: Run
    restart_stats: dict[str, int]


def _settle(server: ServerProcess, at_least: int, quiet_s: float = 2.0, deadline_s: float = 60.0) -> int:
    """Wait for ``at_least`` stores, then until stores stop growing and L2 has written them all."""
    wait_for_stores(server, at_least, deadline_s)
    end, last, since = time.monotonic() + deadline_s, -1, time.monotonic()
    while time.monotonic() < end:
        stats = engine_stats(server)
        if stats["stores"] != last:
            last, since = stats["stores"], time.monotonic()
        elif time.monotonic() - since >= quiet_s and stats.get("l2_writes", last) >= last:
            break
        time.sleep(0.1)
    return last


def _diff(a: Run, b: Run) -> float:
    """max |logprob difference|; inf when either run produced a NaN (a broken load is a change)."""
    values = [abs(x - y) for p, q in zip(a.logprobs, b.logprobs) for x, y in zip(p, q)]
    return math.inf if any(math.isnan(v) for v in values) else max(values)


def _spec(tmp: Path, name: str, chunk: int) -> ServerSpec:
    return ServerSpec(
        listen=f"ipc://{tmp}/{name}.sock",
        l1_bytes=256 * MiB,
        disk_path=str(tmp / "l2"),
        disk_budget=512 * MiB,
        options={"chunk_size": chunk},
    )


def _discovered_n(message: str) -> int | None:
    for pattern in N_PATTERNS:
        found = pattern.search(message)
        if found:
            return int(found.group(1))
    return None


@dataclass
class Cold:
    """What the cold phase leaves once its server (A) has stopped: L2 (``tmp/l2``) keeps the objects."""

    base: Setup
    lengths: list[int]
    groups: dict[bytes, tuple[GroupKind, set[tuple[int, int]]]]  # fingerprint -> kind, stored (prompt, chunk)
    keys: list[ObjectKey]  # every object stored
    target: ObjectKey | None  # the attention object of (CORRUPT_PROMPT, CORRUPT_CHUNK)
    target_bytes: bytes | None


def _cold_phase(tmp: Path, name: str, spec: GpuModel, chunk: int) -> Cold:
    """Server A (L1 + disk in ``tmp``), the cold engine (seeded dummy weights) through it, and what it
    stored once every store reached L2; raises the engine's AssertionError if it failed."""
    lengths = spec.lengths(chunk)
    full = [(p, c) for p, n in enumerate(lengths) for c in range(n // chunk)]
    with cold_setup(
        tmp,
        writer(name),
        lengths,
        chunk=chunk,
        name=name,
        engine_args=spec.engine_args(chunk),
        spec=_spec(tmp, "first", chunk),
        module=SEEDED_DUMMY_RUN,
    ) as base:
        _settle(base.server, len(full))
        index = chunk_index(base.prompt_ids, chunk)
        groups: dict[bytes, tuple[GroupKind, set[tuple[int, int]]]] = {}
        target: ObjectKey | None = None
        target_bytes: bytes | None = None
        stored = stored_manifests(base.server)
        with base.server.client() as c:
            for key, manifest in stored.items():
                kind, chunks = groups.setdefault(key.fingerprint.raw, (manifest.group_kind, set()))
                chunks.add(index[key.prefix_hash])
                if (
                    target is None
                    and kind is not GroupKind.RECURRENT
                    and index[key.prefix_hash] == (CORRUPT_PROMPT, CORRUPT_CHUNK)
                ):
                    target, target_bytes = key, c.get(key)
    return Cold(base, lengths, groups, list(stored), target, target_bytes)


def _check_cold(
    run: Run, lengths: list[int], groups: dict[bytes, tuple[GroupKind, set[tuple[int, int]]]], chunk: int
) -> None:
    """The cold engine computed everything and stored every full chunk in every object group."""
    full = {(p, c) for p, n in enumerate(lengths) for c in range(n // chunk)}
    assert run.num_cached == [0] * len(lengths)
    assert groups, "nothing stored"
    for fingerprint, (kind, chunks) in groups.items():
        # Recurrent groups too: with a prefill step of one chunk the state exists at every chunk end.
        assert chunks == full, (kind, fingerprint.hex()[:16], sorted(full - chunks))


def _rotate_within_groups(server: ServerProcess) -> int:
    """Give every object in ``server``'s L1 the bytes of the next one of its group (by key order):
    valid numbers, wrong KV. Returns how many were rewritten."""
    rotated = 0
    with server.client() as c:
        by_group: dict[bytes, list[ObjectKey]] = {}
        for key in stored_manifests(server):
            by_group.setdefault(key.fingerprint.raw, []).append(key)
        for keys in by_group.values():
            keys.sort(key=lambda k: k.to_bytes())
            data = [c.get(k) for k in keys]
            for key, other in zip(keys, data[1:] + data[:1]):
                assert other is not None
                c.delete(key)
                assert c.put(key, other)
                rotated += 1
    return rotated


@pytest.fixture(scope="module", params=list(MODELS), ids=list(MODELS))
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuSetup]:
    name: str = request.param
    spec = MODELS[name]
    chunk = spec.chunk
    for attempt in range(2):
        tmp = tmp_path_factory.mktemp(f"e2e-gpu-{name}-{chunk}")
        try:
            cold = _cold_phase(tmp, name, spec, chunk)
            break  # server A stopped: its L1 is gone, L2 (tmp/l2) stays
        except AssertionError as failed:
            log = tmp / "cold.log"  # run_engine keeps a failed engine's whole output there
            message = str(failed) + (log.read_text() if log.exists() else "")
            if spec.known_refusal and spec.known_refusal in message:
                pytest.xfail(
                    f"the connector refuses {spec.arch}'s KV-cache groups: {spec.known_refusal} (see docs/hybrid-models.md)"
                )
            n = _discovered_n(message)
            if attempt or n is None or n == chunk:
                raise
            print(
                f"\n[e2e gpu {name}] chunk {chunk} refused; vLLM's block size N = {n}, running again with chunk {n}"
            )
            chunk = n
    assert cold.target_bytes is not None, (
        f"no attention object stored for (prompt {CORRUPT_PROMPT}, chunk {CORRUPT_CHUNK})"
    )
    flipped = _flip_in_lmdb(tmp / "l2", cold.target_bytes)
    server = ServerProcess(_spec(tmp, "restarted", chunk))
    try:
        server.wait_ready()
        setup = GpuSetup.of(
            cold.base,
            spec=spec,
            chunk=chunk,
            lengths=cold.lengths,
            cold_groups=cold.groups,
            corrupt_flipped=flipped,
            restart=Run([], [], []),
            restart_stats={},
        )
        setup.server = server
        setup.restart = setup.run("restart")
        setup.restart_stats = engine_stats(server)
        yield setup
    finally:
        server.stop()


def _flip_in_lmdb(l2: Path, target: bytes) -> int:
    """Flip a 256-byte probe from the last quarter of ``target`` (the last layer's pages: they depend
    on the whole prefix, so no other object holds them) wherever data.mdb has it; return how often."""
    mdb = next(l2.rglob("data.mdb"))
    raw = bytearray(mdb.read_bytes())
    start = len(target) * 3 // 4
    probe = target[start : start + 256]
    hits, at = 0, raw.find(probe)
    while at >= 0:
        for i in range(at, at + len(probe)):
            raw[i] ^= 0xFF
        hits, at = hits + 1, raw.find(probe, at + len(probe))
    mdb.write_bytes(bytes(raw))
    return hits


def _expected_after_corruption(setup: GpuSetup) -> list[int]:
    """Every chunk of the intact prompt; for the corrupted one, the chunks before the corrupted chunk
    with one object group. With several, vLLM 0.32 cannot recover a failed load block by block, so the
    connector fails the request's whole load and vLLM computes it from scratch (0 cached tokens; see
    test_load_failure_hybrid): the L2 index still lists the chunk, its checksum fails only when read."""
    expected = [((n - 1) // setup.chunk) * setup.chunk for n in setup.lengths]
    expected[CORRUPT_PROMPT] = CORRUPT_CHUNK * setup.chunk if len(setup.cold_groups) == 1 else 0
    return expected


@gpu_test
@pytest.mark.gpu
def test_cold_run_stores_every_chunk_in_every_object_group(setup: GpuSetup) -> None:
    kinds = sorted(kind.value for kind, _ in setup.cold_groups.values())
    print(f"\n[e2e gpu {setup.name}] chunk {setup.chunk}, object groups {kinds}")
    _check_cold(setup.cold, setup.lengths, setup.cold_groups, setup.chunk)
    if setup.spec.recurrent:
        assert GroupKind.RECURRENT in {kind for kind, _ in setup.cold_groups.values()}


@gpu_test
@pytest.mark.gpu
def test_restarted_server_serves_l2_hits_and_skips_the_corrupted_chunk(setup: GpuSetup) -> None:
    run, stats = setup.restart, setup.restart_stats
    diff = _diff(run, setup.cold)
    print(
        f"\n[e2e gpu {setup.name} restart] cached tokens {run.num_cached}, chunk hits {stats['lookup_chunks_hit']}, "
        f"promotions {stats['promotions']}, probe copies flipped {setup.corrupt_flipped}, max |logprob diff| {diff:.3g}"
    )
    assert setup.corrupt_flipped >= 1, "the chunk's bytes are not stored verbatim in data.mdb"
    expected = _expected_after_corruption(setup)
    assert run.num_cached == expected
    assert stats["promotions"] >= sum(expected) // setup.chunk  # every hit came from L2
    assert run.tokens == setup.cold.tokens
    assert diff <= TOL


@gpu_test
@pytest.mark.gpu
def test_wrong_bytes_change_the_output(setup: GpuSetup) -> None:
    """Negative control: rotate the objects' contents within each group (every key gets another
    chunk's bytes of the same size: valid numbers, wrong KV); the fresh engine loads them and its
    logprobs move far beyond the tolerance."""
    rotated = _rotate_within_groups(setup.server)
    bad = setup.run("wrong-bytes")
    diff = _diff(bad, setup.cold)
    print(
        f"\n[e2e gpu {setup.name} wrong bytes] {rotated} objects rotated, cached tokens {bad.num_cached}, "
        f"max |logprob diff| {diff:.3g}"
    )
    assert all(n > 0 for n in bad.num_cached)  # it did load the wrong bytes
    assert diff > 10 * TOL


@gpu_test
@pytest.mark.gpu
def test_other_weights_get_no_hits(setup: GpuSetup) -> None:
    model = setup.tmp / "other-weights"
    writer(setup.name)(model, seed=4321)
    hits_before = engine_stats(setup.server)["lookup_chunks_hit"]
    run = setup.run("other-weights", model=model)
    diff = _diff(run, setup.cold)
    print(
        f"\n[e2e gpu {setup.name} other weights] cached tokens {run.num_cached}, max |logprob diff| vs cold {diff:.3g}"
    )
    assert run.num_cached == [0] * len(setup.lengths)
    assert engine_stats(setup.server)["lookup_chunks_hit"] == hits_before
    assert diff > 10 * TOL  # really other weights


# -- the harness itself, on CPU: CI has no GPU ------------------------------------------------------

STAND_IN, STAND_IN_N = "llama_cpu", 32  # vLLM's block size N for the Llama stand-in (docs/hybrid-models.md)


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU the model tests above run the whole harness")
def test_the_harness_itself_on_a_cpu_stand_in(tmp_path: Path) -> None:
    """The GPU tests' machinery on the Llama stand-in, one engine (its chunk given, not discovered):
    what breaks here would break the GPU run, which nothing else in CI exercises."""
    # N discovery: the connector's own refusals (a single block size, and groups of two) name N.
    for chunk, scheduler_block, group_blocks, n in [(48, 32, [32], 32), (256, 128, [128, 384], 384)]:
        with pytest.raises(ConfigError) as refused:
            check_block_sizes(chunk, scheduler_block, group_blocks)
        assert _discovered_n(str(refused.value)) == n
    assert _diff(Run([], [[math.nan]], []), Run([], [[0.0]], [])) == math.inf  # a NaN is a change

    # The cold phase, through the seeded dummy weights: every chunk stored, and logits as sharp as a
    # seeded checkpoint's (vLLM's own dummy weights give flat ones: about -log(vocab) per token).
    spec = CPU_STANDINS[STAND_IN]
    cold = _cold_phase(tmp_path, STAND_IN, spec, STAND_IN_N)
    _check_cold(cold.base.cold, cold.lengths, cold.groups, STAND_IN_N)
    chosen = [lp for prompt in cold.base.cold.logprobs for lp in prompt]
    mean = sum(chosen) / len(chosen)
    assert mean > -math.log(VOCAB) / 2, (
        f"mean chosen-token logprob {mean:.2f}: the seed never reached the weights"
    )
    other = tmp_path / "other-weights"
    writer(STAND_IN)(other, seed=4321)
    assert weights_id(other) != weights_id(cold.base.model)  # another seed: other weights to tiercache

    # The LMDB flip corrupts the probed object and only it: after a restart it misses (its checksum
    # fails), every other object is served from L2.
    assert cold.target is not None and cold.target_bytes is not None
    assert _flip_in_lmdb(tmp_path / "l2", cold.target_bytes) >= 1
    others = [k for k in cold.keys if k != cold.target]
    assert others
    server = ServerProcess(_spec(tmp_path, "restarted", STAND_IN_N))
    try:
        server.wait_ready()
        with server.client() as c:
            assert c.get(cold.target) is None
            before = {k: c.get(k) for k in others}  # promoted into L1 by the reads
        assert all(v is not None for v in before.values())

        # The rotation gives every object another object's bytes of its group, losing none.
        assert _rotate_within_groups(server) == len(others)
        with server.client() as c:
            after = {k: c.get(k) for k in others}
        assert all(after[k] != before[k] for k in others)
        assert sorted(after.values()) == sorted(before.values())  # type: ignore[type-var]
    finally:
        server.stop()
