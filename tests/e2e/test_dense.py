"""A dense Llama-style model on a real vLLM CPU engine, end to end through a real tiercache server.

Each engine runs in its own process (``tests/e2e/engine_run.py``), so every run is a *fresh* engine
with an empty local prefix cache: any cached prompt token it reports came from tiercache. The model
has seeded random weights (not vLLM's dummy weights), so outputs depend on the KV; the corrupted-store
and other-weights tests prove the comparison can fail.

Prompt lengths 200, 150, 257, 130 with chunk 64 give 3+2+4+2 = 11 stored chunks; a fresh engine may
load 3, 2, 4 and 2 chunks (it must compute at least one token itself: 257 = 4 chunks + 1 token).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

from tests.e2e.engine_run import write_tiny_llama
from tests.e2e.setup import MiB, Setup, cold_setup, engine_stats, wait_for_stores
from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.keys import ObjectKey

pytestmark = pytest.mark.e2e

CHUNK = 64
LENGTHS = [200, 150, 257, 130]
EXPECTED_CACHED = [((n - 1) // CHUNK) * CHUNK for n in LENGTHS]  # [192, 128, 256, 128]
STORED_CHUNKS = sum(n // CHUNK for n in LENGTHS)  # 11


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    with cold_setup(tmp_path_factory.mktemp("e2e"), write_tiny_llama, LENGTHS, chunk=CHUNK) as s:
        yield s


def test_cold_run_stores_every_full_prompt_chunk(setup: Setup) -> None:
    assert setup.cold.num_cached == [0] * len(LENGTHS)
    assert wait_for_stores(setup.server, STORED_CHUNKS) == STORED_CHUNKS
    stats = engine_stats(setup.server)
    assert stats["stores_dropped"] == 0


@pytest.mark.parametrize("multiprocess", [False, True], ids=["in-process", "multiprocess"])
def test_fresh_engine_loads_and_matches_cold_run(setup: Setup, multiprocess: bool) -> None:
    wait_for_stores(setup.server, STORED_CHUNKS)
    warm, hits = setup.run_counting_hits(f"warm-{multiprocess}", multiprocess=multiprocess)
    diff = warm.max_logprob_diff(setup.cold)
    print(
        f"\n[e2e dense {'mp' if multiprocess else 'inproc'}] cached tokens {warm.num_cached} "
        f"(server chunk hits {hits}), max |logprob diff| {diff:.3g}"
    )
    assert warm.num_cached == EXPECTED_CACHED
    assert hits == sum(EXPECTED_CACHED) // CHUNK
    assert warm.tokens == setup.cold.tokens
    assert diff <= 1e-5


@pytest.mark.parametrize("skip_layer_waits", [False, True], ids=["layer-waits", "negative-control"])
def test_overlapped_loads_are_ordered_before_each_layer_reads_them(
    setup: Setup, skip_layer_waits: bool
) -> None:
    """With ``overlap_loads`` the pages are written while the forward pass runs; every write here
    sleeps 50 ms first (``slow_load_run``), so only vLLM's ``wait_for_layer_load`` at each attention
    layer keeps a layer from reading blocks not yet written. With the waits the output is the cold
    run's; without them (the negative control) the layers read unwritten blocks and it moves."""
    wait_for_stores(setup.server, STORED_CHUNKS)
    launcher = ["--skip-layer-waits"] if skip_layer_waits else []
    run = setup.run(
        f"overlap-{skip_layer_waits}",
        module="tests.e2e.slow_load_run",
        launcher_args=launcher,
        connector_config={"overlap_loads": True},
    )
    diff = run.max_logprob_diff(setup.cold)
    print(
        f"\n[e2e dense overlapped loads, skip waits={skip_layer_waits}] cached tokens {run.num_cached}, "
        f"max |logprob diff| {diff:.3g}"
    )
    assert run.num_cached == EXPECTED_CACHED
    if skip_layer_waits:
        assert diff > 1e-2
    else:
        assert run.tokens == setup.cold.tokens
        assert diff <= 1e-5


def test_corrupted_store_changes_the_output(setup: Setup) -> None:
    """Negative control: the comparison above can fail. Overwrite every stored chunk with noise of
    the same size; the fresh engine loads it and its logprobs move far beyond the tolerance."""
    wait_for_stores(setup.server, STORED_CHUNKS)
    originals: dict[ObjectKey, bytes] = {}
    rng = np.random.default_rng(0)
    with setup.server.client() as c:
        keys, _ = c.list_keys(tier="l1")
        for listed in keys:
            key = ObjectKey.from_bytes(listed.key)
            data = c.get(key)
            assert data is not None
            originals[key] = data
            c.delete(key)
            assert c.put(key, rng.standard_normal(len(data) // 4).astype(np.float32).tobytes())
    assert len(originals) == STORED_CHUNKS
    try:
        bad = setup.run("corrupt")
    finally:
        with setup.server.client() as c:
            for key, data in originals.items():
                c.delete(key)
                c.put(key, data)
    diff = bad.max_logprob_diff(setup.cold)
    print(f"\n[e2e dense corrupt] cached tokens {bad.num_cached}, max |logprob diff| {diff:.3g}")
    assert bad.num_cached == EXPECTED_CACHED  # it did load the (corrupted) chunks
    assert diff > 1e-2


def test_other_weights_at_the_same_path_get_no_hits(setup: Setup) -> None:
    """Replacing the checkpoint at the same path changes the weights identity in the fingerprint."""
    model = setup.tmp / "swapped-model"
    write_tiny_llama(model, seed=1)
    first = setup.run("swap-a", model=model)
    assert first.num_cached == [0] * len(LENGTHS)
    write_tiny_llama(model, seed=2)  # same path, same config, other weights
    hits_before = engine_stats(setup.server)["lookup_chunks_hit"]
    second = setup.run("swap-b", model=model)
    print(f"\n[e2e dense swapped weights] cached tokens {second.num_cached}")
    assert second.num_cached == [0] * len(LENGTHS)
    assert engine_stats(setup.server)["lookup_chunks_hit"] == hits_before
    assert second.max_logprob_diff(first) > 1e-2  # really other weights


def test_engine_runs_without_a_server(setup: Setup) -> None:
    """Server down: every request is a miss, the outputs are the cold run's, nothing hangs."""
    start = time.monotonic()
    run = setup.run("down", server=f"ipc://{setup.tmp}/nobody-listens.sock")
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
