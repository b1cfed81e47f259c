"""A dense Llama-style model on a real vLLM CPU engine, end to end through a real tiercache server
listening on ``unix://``.

Each engine runs in its own process (``tests/e2e/engine_run.py``), so every run is a *fresh* engine
with an empty local prefix cache: any cached prompt token it reports came from tiercache. The model
has seeded random weights (not vLLM's dummy weights), so outputs depend on the KV; the corrupted-store
and other-weights tests prove the comparison can fail.

Prompt lengths 200, 150, 257, 130 and 200 with chunk 64 give 3+2+4+2+3 = 14 stored chunks; a fresh
engine may load 3, 2, 4, 2 and 3 chunks (it must compute at least one token itself: 257 = 4 chunks +
1 token). The last prompt is the negative control of the fresh in-process engine: its stored chunks
are noise while that engine runs (one engine carries both claims; prompts are generated one at a
time, so the noisy prompt cannot move the others).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

from tests.e2e.engine_run import write_tiny_llama
from tests.e2e.objects import chunk_index
from tests.e2e.setup import MiB, Run, Setup, cold_setup, engine_stats, wait_for_stores
from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.keys import ObjectKey

pytestmark = pytest.mark.e2e

CHUNK = 64
LENGTHS = [200, 150, 257, 130, 200]
EXPECTED_CACHED = [((n - 1) // CHUNK) * CHUNK for n in LENGTHS]  # [192, 128, 256, 128, 192]
STORED_CHUNKS = sum(n // CHUNK for n in LENGTHS)  # 14
NOISY = 4  # the prompt whose chunks are noise for the fresh in-process engine
INTACT = [p for p in range(len(LENGTHS)) if p != NOISY]
UNWAITED = [1, 3]  # the overlapped-loads engine skips the layer waits for these prompts only
WAITED = [p for p in range(len(LENGTHS)) if p not in UNWAITED]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("e2e")
    # Over unix:// (the other engine tests' servers listen on ipc://): the connector's stores,
    # lookups and loads, in process and from vLLM's engine-core process, on the transport without
    # ZeroMQ.
    spec = ServerSpec(listen=f"unix://{tmp}/server.sock", l1_bytes=64 * MiB, options={"chunk_size": CHUNK})
    with cold_setup(tmp, write_tiny_llama, LENGTHS, chunk=CHUNK, spec=spec) as s:
        yield s


def test_cold_run_stores_every_full_prompt_chunk(setup: Setup) -> None:
    assert setup.cold.num_cached == [0] * len(LENGTHS)
    assert wait_for_stores(setup.server, STORED_CHUNKS) == STORED_CHUNKS
    stats = engine_stats(setup.server)
    assert stats["stores_dropped"] == 0


@dataclass(frozen=True)
class Fresh:
    """A fresh engine's run and the chunk hits the server counted meanwhile."""

    run: Run
    hits: int


def _noise_chunks_of(setup: Setup, prompt: int) -> dict[ObjectKey, bytes]:
    """Overwrite every stored chunk of ``prompt`` with noise of the same size; the originals."""
    index = chunk_index(setup.prompt_ids, CHUNK)
    originals: dict[ObjectKey, bytes] = {}
    rng = np.random.default_rng(0)
    with setup.server.client() as c:
        keys, _ = c.list_keys(tier="l1")
        for listed in keys:
            key = ObjectKey.from_bytes(listed.key)
            if index[key.prefix_hash][0] != prompt:
                continue
            data = c.get(key)
            assert data is not None
            originals[key] = data
            c.delete(key)
            assert c.put(key, rng.standard_normal(len(data) // 4).astype(np.float32).tobytes())
    return originals


@pytest.fixture(scope="module")
def in_process(setup: Setup) -> Fresh:
    """One fresh in-process engine while the chunks of prompt :data:`NOISY` are noise (restored
    afterwards): the intact prompts must match the cold run, the noisy one must not."""
    wait_for_stores(setup.server, STORED_CHUNKS)
    originals = _noise_chunks_of(setup, NOISY)
    assert len(originals) == LENGTHS[NOISY] // CHUNK
    try:
        run, hits = setup.run_counting_hits("warm-in-process")
    finally:
        with setup.server.client() as c:
            for key, data in originals.items():
                c.delete(key)
                c.put(key, data)
    return Fresh(run, hits)


def _diff(run: Run, cold: Run, prompts: list[int]) -> float:
    """The largest |logprob difference| of ``run`` and ``cold`` over ``prompts``."""
    return max(abs(a - b) for p in prompts for a, b in zip(run.logprobs[p], cold.logprobs[p]))


@pytest.mark.parametrize("multiprocess", [False, True], ids=["in-process", "multiprocess"])
def test_fresh_engine_loads_and_matches_cold_run(
    setup: Setup, multiprocess: bool, request: pytest.FixtureRequest
) -> None:
    """In-process: the engine of :func:`in_process`, judged on its intact prompts; multiprocess: a
    fresh engine of its own with every prompt intact."""
    if multiprocess:
        wait_for_stores(setup.server, STORED_CHUNKS)
        warm, hits = setup.run_counting_hits("warm-multiprocess", multiprocess=True)
        prompts = list(range(len(LENGTHS)))
    else:
        fresh: Fresh = request.getfixturevalue("in_process")
        warm, hits, prompts = fresh.run, fresh.hits, INTACT
    diff = _diff(warm, setup.cold, prompts)
    print(
        f"\n[e2e dense {'mp' if multiprocess else 'inproc'}] cached tokens {warm.num_cached} "
        f"(server chunk hits {hits}), max |logprob diff| {diff:.3g} over prompts {prompts}"
    )
    assert warm.num_cached == EXPECTED_CACHED
    assert hits == sum(EXPECTED_CACHED) // CHUNK
    assert [warm.tokens[p] for p in prompts] == [setup.cold.tokens[p] for p in prompts]
    assert diff <= 1e-5


def test_overlapped_loads_are_ordered_before_each_layer_reads_them(setup: Setup) -> None:
    """With ``overlap_loads`` the pages are written while the forward pass runs; every write here
    sleeps 50 ms first (``slow_load_run``), so only vLLM's ``wait_for_layer_load`` at each attention
    layer keeps a layer from reading blocks not yet written. One engine: with the waits (prompts
    :data:`WAITED`) the output is the cold run's; without them (prompts :data:`UNWAITED`, the
    negative control) the layers read unwritten blocks and it moves."""
    wait_for_stores(setup.server, STORED_CHUNKS)
    run = setup.run(
        "overlap",
        module="tests.e2e.slow_load_run",
        launcher_args=["--skip-layer-waits-for", ",".join(map(str, UNWAITED))],
        connector_config={"overlap_loads": True},
    )
    waited, unwaited = _diff(run, setup.cold, WAITED), _diff(run, setup.cold, UNWAITED)
    print(
        f"\n[e2e dense overlapped loads] cached tokens {run.num_cached}, max |logprob diff| "
        f"{waited:.3g} with the layer waits (prompts {WAITED}), {unwaited:.3g} without (prompts {UNWAITED})"
    )
    assert run.num_cached == EXPECTED_CACHED
    assert [run.tokens[p] for p in WAITED] == [setup.cold.tokens[p] for p in WAITED]
    assert waited <= 1e-5
    assert unwaited > 1e-2


def test_corrupted_store_changes_the_output(in_process: Fresh, setup: Setup) -> None:
    """Negative control: the comparison above can fail. The chunks of prompt :data:`NOISY` were
    noise of the same size while the in-process engine ran; it loaded them (they count as cached)
    and that prompt's logprobs moved far beyond the tolerance."""
    bad = in_process.run
    diff = _diff(bad, setup.cold, [NOISY])
    print(f"\n[e2e dense corrupt] cached tokens {bad.num_cached[NOISY]}, max |logprob diff| {diff:.3g}")
    assert bad.num_cached[NOISY] == EXPECTED_CACHED[NOISY]  # it did load the (corrupted) chunks
    assert diff > 1e-2


def test_other_weights_at_the_same_path_get_no_hits(setup: Setup) -> None:
    """Replacing the checkpoint at the same path changes the weights identity in the fingerprint:
    with other weights (same config) in the cold run's model directory, a fresh engine finds none of
    the cold run's stored chunks. The original files are put back afterwards."""
    wait_for_stores(setup.server, STORED_CHUNKS)
    original = setup.tmp / "original-model"
    shutil.copytree(setup.model, original)
    write_tiny_llama(setup.model, seed=2)  # same path, same config, other weights
    hits_before = engine_stats(setup.server)["lookup_chunks_hit"]
    try:
        swapped = setup.run("swapped")
    finally:
        shutil.rmtree(setup.model)
        original.rename(setup.model)
    print(f"\n[e2e dense swapped weights] cached tokens {swapped.num_cached}")
    assert swapped.num_cached == [0] * len(LENGTHS)
    assert engine_stats(setup.server)["lookup_chunks_hit"] == hits_before
    assert swapped.max_logprob_diff(setup.cold) > 1e-2  # really other weights


def test_engine_runs_without_a_server(setup: Setup) -> None:
    """Server down: every request is a miss, the outputs are the cold run's, nothing hangs. (A round
    trip is bounded at 1 s here, not the other runs' 5 s: the start-up's ping to nobody costs that.)"""
    start = time.monotonic()
    run = setup.run(
        "down", server=f"ipc://{setup.tmp}/nobody-listens.sock", connector_config={"timeout_s": 1.0}
    )
    assert run.num_cached == [0] * len(LENGTHS)
    assert run.tokens == setup.cold.tokens
    assert run.max_logprob_diff(setup.cold) <= 1e-5
    assert time.monotonic() - start < 120
    assert "tiercache: server at" in run.log and "not reachable" in run.log  # the logged warning


def test_chunk_size_not_a_multiple_of_the_block_size_fails_at_start(setup: Setup, tmp_path: Path) -> None:
    server = ServerProcess(
        ServerSpec(listen=f"ipc://{tmp_path}/s48.sock", l1_bytes=16 * MiB, options={"chunk_size": 48})
    )
    try:
        server.wait_ready()
        with pytest.raises(AssertionError) as failed:
            setup.run("never", server=server.endpoint)
    finally:
        server.stop()
    message = str(failed.value)
    assert "--chunk-size 48 is not a multiple of the vLLM engine's block size 32" in message
