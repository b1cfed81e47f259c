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

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from tests.e2e.engine_run import write_tiny_gemma3
from tests.e2e.setup import LOAD_FAILURE_RUN, Run, Setup, cold_setup
from tests.e2e.test_load_failure import kv_transfer_lines, logged_total

pytestmark = pytest.mark.e2e

CHUNK = 64
LENGTHS = [200, 150, 130]  # hits of 3, 2 and 2 chunks
HIT_CHUNKS = sum((n - 1) // CHUNK for n in LENGTHS)  # 7
STORED_OBJECTS = 2 * sum(n // CHUNK for n in LENGTHS)  # a sliding and a full object per chunk


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """Every run reports vLLM's stats; the failing runs start only once every stored object is in."""
    with cold_setup(
        tmp_path_factory.mktemp("load-failure-gemma3"),
        write_tiny_gemma3,
        LENGTHS,
        chunk=CHUNK,
        prompt_seed=11,
        log_stats=True,
        wait_for_stored=STORED_OBJECTS,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def failing(setup: Setup) -> Run:
    return setup.run("failing", module=LOAD_FAILURE_RUN)


def test_failed_loads_do_not_crash_and_the_output_equals_the_cold_run(setup: Setup, failing: Run) -> None:
    diff = failing.max_logprob_diff(setup.cold)
    print(f"\n[e2e gemma3 load failure] cached tokens {failing.num_cached}, max |logprob diff| {diff:.3g}")
    assert failing.tokens == setup.cold.tokens
    assert diff <= 1e-5
    assert "block-level load failures" not in failing.log


def test_each_failed_load_is_counted_once(failing: Run) -> None:
    m = failing.metrics
    print(f"\n[e2e gemma3 stats failing] {m}")
    assert m["vllm:tiercache_lookups"] == len(LENGTHS)  # the retry after a failure computes, no lookup
    assert m["vllm:tiercache_hit_chunks"] == HIT_CHUNKS
    assert m["vllm:tiercache_load_failures"] == len(LENGTHS)  # the chunk of each prompt's dropped key
    assert m["vllm:tiercache_loaded_chunks"] == HIT_CHUNKS - len(LENGTHS)
    lines = kv_transfer_lines(failing.log)
    assert logged_total(lines, "Load failures") == len(LENGTHS)


def test_without_reporting_the_failures_the_output_is_wrong(setup: Setup) -> None:
    """Negative control: hide failed_recving; vLLM takes the loads as done and computes on blocks
    nobody wrote."""
    hidden = setup.run("hidden", module=LOAD_FAILURE_RUN, launcher_args=["--hide-load-errors"])
    diff = hidden.max_logprob_diff(setup.cold)
    print(
        f"\n[e2e gemma3 load failure hidden] cached tokens {hidden.num_cached}, max |logprob diff| {diff:.3g}"
    )
    assert hidden.num_cached == [((n - 1) // CHUNK) * CHUNK for n in LENGTHS]
    assert diff > 1e-2
