"""Tensor parallelism 2 on a real vLLM CPU engine, end to end through a real tiercache server.

With TP 2 vLLM's ``mp`` executor spawns one worker process per rank, and each rank holds half of the
KV heads (the tiny Llama has 2, so one per rank). The connector stores each rank's pages in its own
object group (``object_group = kv_group * world + rank``, the rank from vLLM's TP/PP groups) with
its own fingerprint (``tp_rank`` is in the manifest), and the scheduler's lookup asks for every
rank's group, so a hit means both ranks can load.

vLLM's CPU executor binds each worker's OpenMP threads to a NUMA node by default
(``VLLM_CPU_OMP_THREADS_BIND=auto``) and refuses to start 2 workers on a single node; CI machines
have one, so the runs here bind rank 0 to CPU 0 and rank 1 to CPU 1 by hand.

Three engine runs: the TP 2 cold run, a fresh TP 2 engine that loads, a TP 1 engine that must not.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.e2e.engine_run import write_tiny_llama
from tests.e2e.objects import chunk_index, stored_manifests
from tests.e2e.setup import (
    ROOT,
    Setup,
    cold_setup,
    engine_stats,
    run_engine,
    wait_for_stores,
)
from tiercache.keys import LayoutManifest, ObjectKey
from tiercache.testing.poll import wait_until

pytestmark = pytest.mark.e2e

CHUNK = 64
LENGTHS = [200, 150, 257, 130]
EXPECTED_CACHED = [((n - 1) // CHUNK) * CHUNK for n in LENGTHS]  # [192, 128, 256, 128]
CHUNKS = sum(n // CHUNK for n in LENGTHS)  # 11 full prompt chunks, stored once per rank
TP = 2
TP_ARGS = {"tensor_parallel_size": TP, "distributed_executor_backend": "mp"}
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one CPU per rank (auto binding wants a NUMA node each)

# Imported by every engine process (the engine and its spawned TP workers) through the PYTHONPATH
# addition: records where each process imported the connector's worker half from, so the test can
# check the TP workers run this checkout's connector and not the venv's installed tiercache.
PROBE = """
import os, sys, threading, time, multiprocessing

def _watch():
    while True:
        mod = sys.modules.get("tiercache.connector.worker")
        if mod is not None:
            spawned = multiprocessing.parent_process() is not None
            with open(os.path.join({out!r}, f"{{os.getpid()}}.json"), "w") as f:
                f.write('{{"spawned": %s, "file": "%s"}}' % ("true" if spawned else "false", mod.__file__))
            return
        time.sleep(0.1)

threading.Thread(target=_watch, name="tiercache-e2e-probe", daemon=True).start()
"""


def tp2_manifests(setup: Setup) -> dict[int, tuple[LayoutManifest, set[bytes]]]:
    """Object group → (its manifest, the prefix hashes stored in it), TP 2 groups only."""
    out: dict[int, tuple[LayoutManifest, set[bytes]]] = {}
    hashes: dict[int, set[bytes]] = defaultdict(set)
    for key, manifest in stored_manifests(setup.server).items():
        if manifest.tp_size == TP:
            out[key.object_group] = (manifest, hashes[key.object_group])
            hashes[key.object_group].add(key.prefix_hash)
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("e2e-tp2")
    probe = tmp / "probe"
    (probe / "seen").mkdir(parents=True)
    (probe / "sitecustomize.py").write_text(PROBE.format(out=str(probe / "seen")))
    with cold_setup(
        tmp,
        write_tiny_llama,
        LENGTHS,
        chunk=CHUNK,
        engine_args=TP_ARGS,
        env=TP_ENV,
        extra_path=probe,
        wait_for_stored=TP * CHUNKS,
    ) as s:
        yield s


def test_cold_run_stores_each_ranks_pages_in_its_own_object_group(setup: Setup) -> None:
    assert setup.cold.num_cached == [0] * len(LENGTHS)
    assert wait_for_stores(setup.server, TP * CHUNKS) == TP * CHUNKS
    assert engine_stats(setup.server)["stores_dropped"] == 0
    groups = tp2_manifests(setup)
    assert sorted(groups) == [0, 1]  # kv group 0 x ranks 0, 1
    every_chunk = set(chunk_index(setup.prompt_ids, CHUNK))
    for rank, (manifest, hashes) in groups.items():
        assert (manifest.tp_rank, manifest.pp_size, manifest.pp_rank) == (rank, 1, 0)
        assert hashes == every_chunk  # each rank stored every full prompt chunk
        assert ("num_kv_heads", "1") in manifest.extra  # half of the model's 2 KV heads
    fingerprints = {m.fingerprint().raw for m, _ in groups.values()}
    print(
        f"\n[e2e tp2] {TP * CHUNKS} objects in object groups {sorted(groups)}, fingerprints "
        f"{sorted(m.fingerprint().hex[:12] for m, _ in groups.values())}"
    )
    assert len(fingerprints) == TP


def test_tp_workers_run_this_checkouts_connector(setup: Setup) -> None:
    seen = [json.loads(p.read_text()) for p in (setup.extra_path or Path()).joinpath("seen").glob("*.json")]
    assert sum(s["spawned"] for s in seen) >= TP, seen  # the mp executor's worker processes
    assert all(Path(s["file"]).is_relative_to(ROOT) for s in seen), seen


def test_fresh_tp2_engine_loads_both_ranks_and_matches_cold_run(setup: Setup) -> None:
    """A hit needs every rank's object: with rank 1's object of prompt 0's last chunk deleted
    (rank 0's is still there) that prompt hits one chunk less; the others load in full. Every prompt
    reproduces the cold run, and rank 1 stores its missing object again."""
    wait_for_stores(setup.server, TP * CHUNKS)
    manifest, _ = tp2_manifests(setup)[1]
    victim = next(
        h for h, (prompt, chunk) in chunk_index(setup.prompt_ids, CHUNK).items() if (prompt, chunk) == (0, 2)
    )
    with setup.server.client() as c:
        assert c.delete(ObjectKey(manifest.fingerprint(), 1, victim)) == 1
    expected = [EXPECTED_CACHED[0] - CHUNK, *EXPECTED_CACHED[1:]]  # [128, 128, 256, 128]
    warm, hits = setup.run_counting_hits("warm")
    diff = warm.max_logprob_diff(setup.cold)
    print(
        f"\n[e2e tp2] rank 1 lacks one object: cached tokens {warm.num_cached} (server chunk hits {hits}), "
        f"max |logprob diff| {diff:.3g}"
    )
    assert warm.num_cached == expected
    assert hits == sum(expected) // CHUNK
    assert warm.tokens == setup.cold.tokens
    assert diff <= 1e-5
    wait_until(
        lambda: victim in tp2_manifests(setup)[1][1], interval=0.1, what="rank 1 to store its object again"
    )
    assert tp2_manifests(setup)[1][1] == set(chunk_index(setup.prompt_ids, CHUNK))  # stored again


def test_tp1_engine_gets_no_hits_from_tp2_objects(setup: Setup) -> None:
    """Same model, prompts and server, one rank: its pages hold both KV heads, so its fingerprint
    differs from either TP 2 rank's and nothing the TP 2 engines stored can be a hit. (Last: it
    stores its own objects.)"""
    stats = engine_stats(setup.server)
    hits_before, stores_before = stats["lookup_chunks_hit"], stats["stores"]
    tp1 = run_engine(setup.model, setup.server.endpoint, setup.prompts, setup.tmp / "tp1.json")
    diff = tp1.max_logprob_diff(setup.cold)
    print(f"\n[e2e tp1 after tp2] cached tokens {tp1.num_cached}, max |logprob diff| vs TP 2 {diff:.3g}")
    assert tp1.num_cached == [0] * len(LENGTHS)
    assert engine_stats(setup.server)["lookup_chunks_hit"] == hits_before
    assert (
        wait_for_stores(setup.server, stores_before + CHUNKS) == stores_before + CHUNKS
    )  # under its own fingerprint
    tp2_fingerprints = {m.fingerprint().raw for m, _ in tp2_manifests(setup).values()}
    tp1_fingerprints = {
        m.fingerprint().raw for m in stored_manifests(setup.server).values() if m.tp_size == 1
    }
    assert len(tp1_fingerprints) == 1 and not tp1_fingerprints & tp2_fingerprints
