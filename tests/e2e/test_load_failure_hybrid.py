"""A load that fails on a model with several KV-cache groups (tiny Gemma 3: sliding window + full
attention) neither crashes the engine nor changes its output.

vLLM cannot map block-level load errors back to requests when there are several KV-cache groups (it
raises), so for such models the connector loads asynchronously in vLLM's sense: the request waits
in ``WAITING_FOR_REMOTE_KVS``, the workers report it in ``finished_recving`` and a failed load also
in ``failed_recving``; vLLM then frees its blocks and computes it from scratch.

A cold engine stores the prompts' chunks (two objects each: one per group). A fresh engine then
loads them, but every pin loses its second key (``tests/e2e/load_failure_run.py``), so one object of
every hit fails: the engine must finish, match the cold run, and count one failure per prompt.
The negative control hides the failures from vLLM: it then computes on blocks nobody wrote, and
the output moves.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.e2e.engine_run import make_prompts, write_tiny_gemma3
from tests.e2e.test_load_failure import Run, kv_transfer_lines, logged_total, run_engine
from tests.server.serverproc import ServerProcess, ServerSpec

pytestmark = pytest.mark.e2e

CHUNK = 64
LENGTHS = [200, 150, 130]  # hits of 3, 2 and 2 chunks
HIT_CHUNKS = sum((n - 1) // CHUNK for n in LENGTHS)  # 7
STORED_OBJECTS = 2 * sum(n // CHUNK for n in LENGTHS)  # a sliding and a full object per chunk
MiB = 1 << 20


@dataclass
class Setup:
    tmp: Path
    model: Path
    prompts: Path
    server: ServerProcess
    cold: Run
    failing: Run


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("load-failure-gemma3")
    model = tmp / "model"
    write_tiny_gemma3(model, seed=1234)
    prompts = tmp / "prompts.json"
    prompts.write_text(json.dumps(make_prompts(LENGTHS, seed=11)))
    server = ServerProcess(ServerSpec(listen=f"ipc://{tmp}/server.sock", l1_bytes=64 * MiB, options={"chunk_size": CHUNK}))
    try:
        server.wait_ready()
        cold = run_engine("tests.e2e.engine_run", model, server.endpoint, prompts, tmp / "cold.json")
        with server.client() as c:  # stores of the last request may commit after the run's end
            for _ in range(600):
                if c.stats()["engine"]["stores"] >= STORED_OBJECTS:
                    break
                time.sleep(0.05)
        failing = run_engine("tests.e2e.load_failure_run", model, server.endpoint, prompts, tmp / "failing.json")
        yield Setup(tmp, model, prompts, server, cold, failing)
    finally:
        server.stop()


def test_failed_loads_do_not_crash_and_the_output_equals_the_cold_run(setup: Setup) -> None:
    diff = setup.failing.max_logprob_diff(setup.cold)
    print(f"\n[e2e gemma3 load failure] cached tokens {setup.failing.num_cached}, max |logprob diff| {diff:.3g}")
    assert setup.failing.tokens == setup.cold.tokens
    assert diff <= 1e-5
    assert "block-level load failures" not in setup.failing.log


def test_each_failed_load_is_counted_once(setup: Setup) -> None:
    m = setup.failing.metrics
    print(f"\n[e2e gemma3 stats failing] {m}")
    assert m["vllm:tiercache_lookups"] == len(LENGTHS)  # the retry after a failure computes, no lookup
    assert m["vllm:tiercache_hit_chunks"] == HIT_CHUNKS
    assert m["vllm:tiercache_load_failures"] == len(LENGTHS)  # the chunk of each prompt's dropped key
    assert m["vllm:tiercache_loaded_chunks"] == HIT_CHUNKS - len(LENGTHS)
    lines = kv_transfer_lines(setup.failing.log)
    assert logged_total(lines, "Load failures") == len(LENGTHS)


def test_without_reporting_the_failures_the_output_is_wrong(setup: Setup) -> None:
    """Negative control: hide failed_recving; vLLM takes the loads as done and computes on blocks
    nobody wrote."""
    hidden = run_engine("tests.e2e.load_failure_run", setup.model, setup.server.endpoint, setup.prompts,
                        setup.tmp / "hidden.json", "--hide-load-errors")
    diff = hidden.max_logprob_diff(setup.cold)
    print(f"\n[e2e gemma3 load failure hidden] cached tokens {hidden.num_cached}, max |logprob diff| {diff:.3g}")
    assert hidden.num_cached == [((n - 1) // CHUNK) * CHUNK for n in LENGTHS]
    assert diff > 1e-2
