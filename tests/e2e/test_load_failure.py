"""A chunk that fails to load is recomputed by vLLM, end to end; and the connector's stats reach vLLM.

A cold engine stores the prompts' chunks. A fresh engine then loads them, but every pin loses its
second key (``tests/e2e/load_failure_run.py``: the object "vanished" between lookup and pin), so the
second hit chunk of every prompt cannot be loaded. With ``kv_load_failure_policy="recompute"`` the
worker reports those blocks and vLLM recomputes them: the output must equal the cold run. The
negative control hides the load errors from vLLM: it then computes on blocks nobody wrote, and the
output moves, proving the recompute is what keeps it right.

Both the cold run and the failing run run vLLM's stat loggers (``--log-stats``): the connector's
stores, lookups, hits, loads and load failures must show in vLLM's Prometheus metrics
(``vllm:tiercache_*``) and in its "KV Transfer metrics:" log line.

A lease lost mid-copy is a failed load too: on a server whose leases last 1 s, a fresh engine's
first copy stalls 2.5 s while another client's stores reuse the slot it copies from
(``tests/e2e/lost_lease_run.py``). The release says the leases expired, so the worker reports those
chunks failed and vLLM recomputes them: the output equals the cold run's. The negative control
trusts every release, as tiercache did before releases named lost leases: it uses the reused bytes
and its output moves.

A prefill engine (``kv_producer``) whose save backlog outlasts its reservations: on a server whose
reservations last 1 s, every store's copy starts 2.5 s late (``tests/e2e/slow_store_site``), after
the time rule let it start. Its late bytes land in slots the server keeps out of use, its commits
are refused, and an engine after it recomputes what was not stored: its output equals the cold
run's, and no object's digest ever failed.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.e2e.engine_run import write_tiny_llama
from tests.e2e.setup import LOAD_FAILURE_RUN, MiB, Run, Setup, cold_setup, run_engine
from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.keys import ObjectKey
from tiercache.testing.poll import wait_until

pytestmark = pytest.mark.e2e

CHUNK = 64
LENGTHS = [200, 150, 130]  # hits of 3, 2 and 2 chunks; the pin of each loses chunk 1
HIT_CHUNKS = sum((n - 1) // CHUNK for n in LENGTHS)  # 7
RECOVERED = re.compile(
    r"Recovered from KV load failure: (\d+) request\(s\) rescheduled \((\d+) tokens affected\)"
)


def kv_transfer_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "KV Transfer metrics:" in line]


def logged_total(lines: list[str], field: str) -> int:
    """A counter summed over the log lines (one per logging interval)."""
    total = 0
    for line in lines:
        for part in line.split("KV Transfer metrics:", 1)[1].split(","):
            key, _, value = part.strip().partition("=")
            if key == field:
                total += int(value)
    return total


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """Every run reports vLLM's stats; the failing runs start only once every stored chunk is in."""
    with cold_setup(
        tmp_path_factory.mktemp("load-failure"),
        write_tiny_llama,
        LENGTHS,
        chunk=CHUNK,
        prompt_seed=11,
        log_stats=True,
        wait_for_stored=sum(n // CHUNK for n in LENGTHS),
    ) as s:
        yield s


@pytest.fixture(scope="module")
def failing(setup: Setup) -> Run:
    return setup.run("failing", module=LOAD_FAILURE_RUN)


def test_cold_run_reports_lookups_and_stores_in_vllm_metrics(setup: Setup) -> None:
    m = setup.cold.metrics
    print(f"\n[e2e stats cold] {m}")
    assert setup.cold.num_cached == [0] * len(LENGTHS)
    assert m["vllm:tiercache_lookups"] == len(LENGTHS)
    assert m["vllm:tiercache_query_tokens"] == HIT_CHUNKS * CHUNK
    assert m["vllm:tiercache_hit_tokens"] == 0
    assert m["vllm:tiercache_stored_chunks"] > 0  # the last ones may land after the final step
    assert m["vllm:tiercache_stored_bytes"] > 0
    assert m["vllm:tiercache_loaded_chunks"] == 0


def test_failed_loads_are_recomputed_and_the_output_equals_the_cold_run(setup: Setup, failing: Run) -> None:
    diff = failing.max_logprob_diff(setup.cold)
    print(f"\n[e2e load failure] cached tokens {failing.num_cached}, max |logprob diff| {diff:.3g}")
    assert failing.tokens == setup.cold.tokens
    assert diff <= 1e-5
    # vLLM keeps the chunk before the failed one and recomputes from there on (it does not
    # lower the request's reported num_cached_tokens, so its own log line is the evidence).
    recovered = [tuple(map(int, m)) for m in RECOVERED.findall(failing.log)]
    assert sum(r for r, _ in recovered) == len(LENGTHS)
    assert sum(t for _, t in recovered) == sum((n - 1) // CHUNK - 1 for n in LENGTHS) * CHUNK


def test_the_failing_run_reports_hits_loads_and_failures(failing: Run) -> None:
    m = failing.metrics
    print(f"\n[e2e stats failing] {m}")
    assert m["vllm:tiercache_lookups"] == len(LENGTHS)
    assert m["vllm:tiercache_hit_chunks"] == HIT_CHUNKS
    assert m["vllm:tiercache_hit_tokens"] == HIT_CHUNKS * CHUNK
    assert m["vllm:tiercache_hit_objects[l1]"] == HIT_CHUNKS  # one object group: object = chunk
    assert m["vllm:tiercache_load_failures"] == len(LENGTHS)  # chunk 1 of each prompt
    assert m["vllm:tiercache_loaded_chunks"] == HIT_CHUNKS - len(LENGTHS)
    assert m["vllm:tiercache_loaded_bytes"] > 0
    assert m["vllm:tiercache_load_seconds.count"] >= 1
    lines = kv_transfer_lines(failing.log)
    print("\n".join(lines))
    assert lines, "vLLM logged no 'KV Transfer metrics:' line"
    assert logged_total(lines, "Lookups") == len(LENGTHS)
    assert logged_total(lines, "Load failures") == len(LENGTHS)
    assert any("Hit rate (%)=100.0" in line and "Hits from l1 (%)=100.0" in line for line in lines)


def test_without_reporting_load_errors_the_output_is_wrong(setup: Setup) -> None:
    """Negative control: hide the load errors; vLLM computes on blocks no one wrote."""
    hidden = setup.run("hidden", module=LOAD_FAILURE_RUN, launcher_args=["--hide-load-errors"])
    diff = hidden.max_logprob_diff(setup.cold)
    print(f"\n[e2e load failure hidden] cached tokens {hidden.num_cached}, max |logprob diff| {diff:.3g}")
    assert hidden.num_cached == [((n - 1) // CHUNK) * CHUNK for n in LENGTHS]
    assert diff > 1e-2


LEASE_TTL_S = 1.0
LOST_LEASE_RUN = "tests.e2e.lost_lease_run"


def _copy_of_the_cache(setup: Setup, name: str) -> ServerProcess:
    """A server whose leases last :data:`LEASE_TTL_S`, with a small L1 holding every stored chunk."""
    server = ServerProcess(
        ServerSpec(
            listen=f"ipc://{setup.tmp}/{name}.sock",
            l1_bytes=4 * MiB,
            l1_lease_ttl_s=LEASE_TTL_S,
            options={"chunk_size": CHUNK},
        )
    )
    server.wait_ready()
    with setup.server.client() as source, server.client() as target:
        listed, _ = source.list_keys(tier="l1")
        for entry in listed:
            key = ObjectKey.from_bytes(entry.key)
            data = source.get(key)
            assert data is not None and target.put(key, data)
    return server


@pytest.mark.parametrize("trust", [False, True], ids=["reported", "negative-control"])
def test_a_copy_that_outlives_its_lease_is_recomputed_not_used(setup: Setup, trust: bool) -> None:
    server = _copy_of_the_cache(setup, f"lost-lease-{trust}")
    try:
        launcher = ["--flood-server", server.endpoint, *(["--trust-lost-leases"] if trust else [])]
        run = setup.run(
            f"lost-lease-{trust}", server=server.endpoint, module=LOST_LEASE_RUN, launcher_args=launcher
        )
        with server.client() as c:
            # Counted at the ticket's release; a release that never came (the copy stalled past
            # the connector's link) counts once the server ends the ticket or the silent session.
            with contextlib.suppress(TimeoutError):  # the assertion below says what was missing
                wait_until(
                    lambda: c.stats()["server"]["leases_lost"] >= 1,
                    timeout=40,
                    interval=0.2,
                    what="the server to count the stalled copy's leases as lost",
                )
            stats = c.stats()["server"]
            lost = stats["leases_lost"]
    finally:
        server.stop()
    diff = run.max_logprob_diff(setup.cold)
    reported = run.metrics.get("vllm:tiercache_lost_leases", 0)
    print(
        f"\n[e2e lost lease, trusted={trust}] server leases lost {lost} (tickets ended "
        f"{stats['tickets_expired']}, clients expired {stats['clients_expired']}), connector lost_leases {reported}, "
        f"cached tokens {run.num_cached}, max |logprob diff| {diff:.3g}"
    )
    assert "the slot was reused" in run.log
    assert lost >= 1  # the server saw the lease expire before its release
    # The first prompt's hit was loaded (its copy stalled); the flood evicted the others' chunks.
    assert run.num_cached[0] == ((LENGTHS[0] - 1) // CHUNK) * CHUNK
    if trust:
        assert reported == 0
        assert diff > 1e-2  # the reused bytes were computed with
    else:
        assert reported >= 1
        assert run.tokens == setup.cold.tokens
        assert diff <= 1e-5
        assert RECOVERED.search(run.log), "vLLM did not recompute the failed chunks"


RESERVATION_TTL_S = 1.0
STORE_LATE_BY_S = 2.5
SLOW_STORE_SITE = Path(__file__).parent / "slow_store_site"


def test_a_producers_stores_that_outlast_their_reservations_never_reach_a_reader(setup: Setup) -> None:
    server = ServerProcess(
        ServerSpec(
            listen=f"ipc://{setup.tmp}/late-producer.sock",
            l1_bytes=16 * MiB,
            l1_options={"reservation_ttl_s": RESERVATION_TTL_S},
            options={"chunk_size": CHUNK},
        )
    )
    server.wait_ready()
    try:
        produced = run_engine(
            setup.model,
            server.endpoint,
            setup.prompts,
            setup.tmp / "late-producer.json",
            launcher_args=["--kv-role", "kv_producer"],
            engine_args=setup.engine_args,
            extra_path=SLOW_STORE_SITE,
            env={"TIERCACHE_TEST_STORE_DELAY_S": str(STORE_LATE_BY_S)},
        )
        after = setup.run("after-late-producer", server=server.endpoint)
        with server.client() as c:
            stats = c.stats()
    finally:
        server.stop()
    l1 = stats["tiers"]["l1"]
    integrity = {k: v for k, v in stats["engine"].items() if k.startswith("integrity_failures_")}
    print(
        f"\n[e2e late producer] expired reservations {l1['expired_reservations']}, quarantined "
        f"{l1['quarantined']} (writers done {l1['quarantine_writer_done']}), stores {stats['engine']['stores']}, "
        f"integrity {integrity}, after: cached {after.num_cached}"
    )
    assert produced.tokens == setup.cold.tokens
    assert l1["expired_reservations"] >= 1 and l1["quarantined"] >= 1  # the late copies landed there
    assert not any(integrity.values())
    assert after.tokens == setup.cold.tokens
    assert after.max_logprob_diff(setup.cold) <= 1e-5
