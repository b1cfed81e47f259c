"""Two replicas on one bucket: two nodes' worth on one machine, each a tiercache server (its own L1, its
own disk (LMDB), the one S3 bucket and prefix they share) behind its own vLLM OpenAI server (the
multiprocess engine as ``vllm serve`` runs it). Nothing is mocked. The bucket is on a throwaway Ceph
cluster's RADOS Gateway (``rgw_server``: a real S3-compatible store), or on moto's server over real
HTTP where the Ceph packages are missing (never in CI). (It ran on both until CI's vLLM stage needed
the time; the S3 tier itself is checked on both by tests/l3_s3.)

The claims:

1. *node A computes and shares*: A's engine computes every prompt token; its tiercache server stores
   each full prompt chunk once and writes it through to S3 (``l3_write_policy`` ``through``), and the
   bucket then holds exactly the chunk hashes of the prompts (listed with boto3, not asked of the
   server), under one fingerprint with its manifest. A also computes the *probe* prompt (one chunk),
   which B asks only after the restart (claim 3).
2. *node B reuses what A computed*: B's engine (fresh, its own empty tiercache server) asked the same
   prompts loads every full chunk from tiercache (``cached_tokens``, and vLLM's own count of
   connector hits), answers A's text with A's logprobs (within :data:`LOGPROB_TOLERANCE`), and stores
   nothing; its connector's lookups found every chunk in S3 (``vllm:tiercache_hit_objects{tier}``),
   and so did B's server (its disk missed, S3 hit, each chunk promoted once), which then holds them in
   its L1: exactly the bucket's objects of those prompts.
3. *a restarted node warms from S3*: B's tiercache server restarts with a fresh, empty disk directory
   on the same endpoint (vLLM B keeps running), ``tiercache warm --tier s3`` promotes every chunk of
   the bucket into the new L1, and the prompts asked again (vLLM B's own prefix cache reset first,
   through its dev-mode ``/reset_prefix_cache``, so every cached token comes from tiercache) hit every
   full chunk with A's answers, served from L1 (the connector's hits by tier say ``l1`` only): no S3
   or disk read, no promotion, nothing stored during the requests.

   Before them vLLM B is sent the probe (a chunk A computed and B never asked): its lookup is often
   the first call that meets the restarted server, which answers ``hello_required``; the client says
   hello again and resends it, so the restart is no outage: the probe hits (64 tokens, from the
   warmed L1) with A's answer, and the connector logged no outage since the restart. (Before that
   fix, an asynchronous lookup raised instead, the connector went down for ``retry_s`` and the probe
   missed, depending on whether the heartbeat had said hello first.)

The two nodes share the checkpoint directory (the layout fingerprint names the model by its path, as
it would be the same path on every node of a fleet) and set the same ``weights_id``, as the operations
guide recommends for a fleet. Two vLLM server starts (in parallel) per store, ~1-2 minutes each on two cores.

Chunk 64, vLLM blocks 32. Prompts of 200, 150, 257 and 130 tokens: 3, 2, 4 and 2 full chunks, all
stored by A; a fresh engine can take 192, 128, 256 and 128 prompt tokens of each from tiercache (vLLM
computes at least the last prompt token). The probe has 65 tokens: one chunk.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import boto3
import httpx
from botocore.config import Config
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import S3Endpoint
from tests.e2e.engine_run import make_prompts, write_served_tiny_llama
from tests.e2e.openai_server import (
    EXTERNAL_HITS,
    Completion,
    OpenAIServer,
    api_server_argv,
    tiny_model_flags,
)
from tests.e2e.setup import PATIENT_LOOKUPS, PATIENT_S3, MiB, cli_json, wait_for
from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.config.parts import L3WritePolicy
from tiercache.keys import ExtraKeys, PrefixHasher
from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey
from tiercache.l3_s3.names import ObjectNames
from tiercache.testing.checkpoints import token_text
from tiercache.testing.poll import wait_until
from tiercache.testing.rgw import missing_programs

pytestmark = pytest.mark.e2e

CHUNK = 64
VOCAB = 512  # the tiny Llama's
LENGTHS = [200, 150, 257, 130]
MAX_TOKENS = 8
#: What a fresh engine takes from tiercache: every full chunk but one holding the last prompt token.
EXPECTED_CACHED = [((n - 1) // CHUNK) * CHUNK for n in LENGTHS]  # [192, 128, 256, 128]
PROBE_LENGTH = CHUNK + 1
PROMPT_CHUNKS = sum(n // CHUNK for n in LENGTHS)  # 11
STORED_CHUNKS = PROMPT_CHUNKS + PROBE_LENGTH // CHUNK  # 12: what A stores, prompts and probe
LOADED_CHUNKS = sum(EXPECTED_CACHED) // CHUNK  # 11: what a fresh engine loads of the prompts
#: Same engine build and kernels on both nodes: a loaded prefix matches a computed one to ~1e-6 in
#: float32; a wrong KV moves logprobs by ~1.
LOGPROB_TOLERANCE = 1e-3
PREFIX = "replicas"  # the S3 prefix both nodes share
WEIGHTS_ID = "tiny-llama-seed-1234"
RETRY_S = 1.0  # how often vLLM B's connector tries a server it lost again
# A round trip bound far above the 2 s default: in CI two vLLM engines (and another shard's) share two
# cores, and a write-through commit late by 2 s would take the link down and skip the next stores.
TIMEOUT_S = 10.0
#: What a connector half's link logs (tiercache/client/link.py): on each (re)connect, and once per
#: outage when a call fails. vLLM B has two halves (scheduler and worker), each connected at start.
CONNECTED = "tiercache: connected to"
FAILED_WARNING = "treating the cache as unavailable"
HALVES = 2
#: The connector's lookup hits by the tier that held each object (its ``per_tier``), in vLLM's /metrics.
TIER_HITS = "vllm:tiercache_hit_objects_total"
#: The times a connector found its server unreachable, in vLLM's /metrics.
OUTAGES = "vllm:tiercache_server_unavailable_total"


def prompt_keys(prompt_ids: list[list[int]]) -> set[bytes]:
    """The prefix hashes of every full chunk of the prompts (tiercache's chunk keys, computed here)."""
    return {h for ids in prompt_ids for h in PrefixHasher(CHUNK, ExtraKeys()).update(ids)}


@dataclass
class Bucket:
    """What the shared bucket holds under :data:`PREFIX`, listed with boto3 (not through tiercache)."""

    chunks: list[ObjectKey]
    manifests: list[Fingerprint]
    others: list[str]  # names that are neither


def list_bucket(s3: S3Endpoint, bucket: str) -> Bucket:
    client = boto3.client(
        "s3",
        endpoint_url=s3.url,
        region_name=s3.region,
        config=Config(s3={"addressing_style": "path"}),
    )
    names = ObjectNames(PREFIX)
    out = Bucket([], [], [])
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=names.root):
        for obj in page.get("Contents", []):
            name = obj["Key"]
            key, fp = names.key_of(name), names.fingerprint_of(name)
            if key is not None:
                out.chunks.append(key)
            elif fp is not None:
                out.manifests.append(fp)
            else:
                out.others.append(name)
    return out


def server_stats(server: ServerProcess) -> dict[str, Any]:
    """The whole ``stats`` reply: ``engine``, ``tiers`` (``l1``, ``disk``, ``s3``) and ``server``."""
    with server.client() as c:
        return c.stats()


def delta(before: dict[str, Any], after: dict[str, Any], *path: str) -> int:
    """``after[path] - before[path]`` for one counter of :func:`server_stats`."""
    a: Any = after
    b: Any = before
    for p in path:
        a, b = a[p], b[p]
    return int(a) - int(b)


def l1_keys(server: ServerProcess) -> list[ObjectKey]:
    """Every key the server's L1 holds."""
    with server.client() as c:
        keys, cursor = c.list_keys(tier="l1", limit=10_000)
        assert cursor == b""
    return [ObjectKey.from_bytes(k.key) for k in keys]


def hits_by_tier(vllm: OpenAIServer) -> dict[str, float]:
    """:data:`TIER_HITS` by its ``tier`` label (:meth:`OpenAIServer.metrics` sums labels away)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{vllm.url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == TIER_HITS:
                tier = sample.labels["tier"]
                out[tier] = out.get(tier, 0.0) + sample.value
    return out


def connector_warnings(vllm: OpenAIServer) -> list[str]:
    """The connector's warning lines in ``vllm``'s log, for a failure's message."""
    return [line for line in vllm.log_text().splitlines() if "tiercache" in line and "WARNING" in line]


def tier_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What :func:`hits_by_tier` gained, tiers that gained nothing left out."""
    return {t: n - before.get(t, 0.0) for t, n in after.items() if n != before.get(t, 0.0)}


def max_diff(a: list[Completion], b: list[Completion]) -> float:
    return max(x.max_logprob_diff(y) for x, y in zip(a, b, strict=True))


@dataclass
class Replicas:
    tmp: Path
    s3: S3Endpoint
    bucket: str
    prompt_ids: list[list[int]]
    prompts: list[str]
    probe_ids: list[int]
    probe: str
    server_a: ServerProcess
    server_b: ServerProcess
    vllm_a: OpenAIServer
    vllm_b: OpenAIServer

    def node_spec(self, name: str, disk: str) -> ServerSpec:
        return node_spec(self.tmp, name, disk, self.s3, self.bucket)

    def ask(self, vllm: OpenAIServer) -> list[Completion]:
        return [vllm.complete(p, MAX_TOKENS) for p in self.prompts]


def node_spec(tmp: Path, name: str, disk: str, s3: S3Endpoint, bucket: str) -> ServerSpec:
    """One node's tiercache server: its own socket, L1 and disk directory ``disk``; the shared bucket
    and prefix; every stored chunk written through to S3."""
    return ServerSpec(
        listen=f"ipc://{tmp}/{name}.sock",
        l1_bytes=64 * MiB,
        disk_path=str(tmp / disk),
        s3_url=s3.url,
        s3_bucket=bucket,
        options={"chunk_size": CHUNK},
        # The claims are about what the nodes share, not how fast the bucket answers (PATIENT_S3):
        # with the defaults, CI lost a prompt's three chunks to the lookup's budget once, and another
        # prompt's two with no question past it (a HEAD late by its own 0.5 s, it seems).
        s3_options={"prefix": PREFIX, **PATIENT_S3},
        engine_options={"l3_write_policy": L3WritePolicy.THROUGH, **PATIENT_LOOKUPS},
    )


def vllm_argv(model: Path, endpoint: str) -> list[str]:
    transfer = {
        "kv_connector": "TierCacheConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "server": endpoint,
            "retry_s": RETRY_S,
            "timeout_s": TIMEOUT_S,
            "weights_id": WEIGHTS_ID,
        },
    }
    return api_server_argv(model, *tiny_model_flags(128), f"--kv-transfer-config={json.dumps(transfer)}")


@pytest.fixture(scope="module")
def store(request: pytest.FixtureRequest) -> S3Endpoint:
    """The object store behind the shared bucket: Ceph RGW, or moto where Ceph is not installed
    (outside CI, whose rgw_server fails instead)."""
    use_moto = bool(missing_programs()) and os.environ.get("CI") != "true"
    endpoint: S3Endpoint = request.getfixturevalue("s3_server" if use_moto else "rgw_server")
    return endpoint


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory, store: S3Endpoint) -> Iterator[Replicas]:
    tmp = tmp_path_factory.mktemp("replicas")
    bucket = f"e2e-replicas-{uuid.uuid4().hex[:8]}"
    model = tmp / "model"
    write_served_tiny_llama(model, seed=1234)
    ids = make_prompts(LENGTHS, seed=23, vocab=VOCAB)
    [probe] = make_prompts([PROBE_LENGTH], seed=29, vocab=VOCAB)
    spec_a = node_spec(tmp, "node-a", "disk-a", store, bucket)
    spec_b = node_spec(tmp, "node-b", "disk-b", store, bucket)
    started: list[ServerProcess | OpenAIServer] = []
    try:
        server_a = ServerProcess(spec_a)
        started.append(server_a)
        server_b = ServerProcess(spec_b)
        started.append(server_b)
        server_a.wait_ready()
        server_b.wait_ready()
        vllm_a = OpenAIServer(vllm_argv(model, spec_a.listen), tmp / "vllm-a.log")
        started.append(vllm_a)
        # Dev mode: vLLM B's local prefix cache can be reset (POST /reset_prefix_cache) before the
        # prompts are asked again, so every cached token it reports then came from tiercache.
        vllm_b = OpenAIServer(
            vllm_argv(model, spec_b.listen), tmp / "vllm-b.log", env={"VLLM_SERVER_DEV_MODE": "1"}
        )
        started.append(vllm_b)
        vllm_a.wait_ready()
        vllm_b.wait_ready()
        r = Replicas(
            tmp,
            store,
            bucket,
            ids,
            [token_text(p) for p in ids],
            probe,
            token_text(probe),
            server_a,
            server_b,
            vllm_a,
            vllm_b,
        )
        yield r
        started.append(r.server_b)  # the restarted one, if the module got that far
    finally:
        for part in reversed(started):
            part.stop()


# -- 1. node A computes, stores and writes through to S3 -------------------------------------------
@dataclass
class NodeA:
    answers: list[Completion]
    probe: Completion
    stats: dict[str, Any]
    l3_writes: int
    bucket: Bucket
    skipped: float  # vLLM A's connector: chunks it did not store (server down, full or busy)
    outages: float  # and the times it found the server unreachable
    warnings: list[str]  # the connector's warnings in vLLM A's log, for a failure's message


@pytest.fixture(scope="module")
def node_a(replicas: Replicas) -> NodeA:
    answers = replicas.ask(replicas.vllm_a)
    probe = replicas.vllm_a.complete(replicas.probe, MAX_TOKENS)
    wait_for(replicas.server_a, "stores", STORED_CHUNKS)
    l3_writes = wait_for(replicas.server_a, "l3_writes", STORED_CHUNKS)
    vllm = replicas.vllm_a
    return NodeA(
        answers,
        probe,
        server_stats(replicas.server_a),
        l3_writes,
        list_bucket(replicas.s3, replicas.bucket),
        vllm.metric("vllm:tiercache_store_skipped_total"),
        vllm.metric(OUTAGES),
        connector_warnings(vllm),
    )


def test_node_a_computes_every_prompt_token(node_a: NodeA) -> None:
    answers = [*node_a.answers, node_a.probe]
    assert [c.prompt_tokens for c in answers] == [*LENGTHS, PROBE_LENGTH]
    assert [c.cached_tokens for c in answers] == [0] * len(answers)
    assert all(len(c.logprobs) == MAX_TOKENS for c in answers)


def test_node_a_writes_every_full_chunk_through_to_the_shared_bucket(
    replicas: Replicas, node_a: NodeA
) -> None:
    engine = node_a.stats["engine"]
    listed = {k.prefix_hash for k in node_a.bucket.chunks}
    print(
        f"\n[replicas A] stores {engine['stores']}, l2_writes {engine['l2_writes']}, l3_writes "
        f"{node_a.l3_writes}; bucket: {len(node_a.bucket.chunks)} chunk objects, "
        f"{len(node_a.bucket.manifests)} manifest(s), other {node_a.bucket.others}; connector: "
        f"{node_a.skipped:g} stores skipped, {node_a.outages:g} outages"
    )
    assert engine["stores"] == STORED_CHUNKS, "\n".join(node_a.warnings)
    assert engine["l2_writes"] == STORED_CHUNKS
    assert node_a.l3_writes == STORED_CHUNKS
    assert engine["write_failures"] == engine["l3_queue_drops"] == 0
    # The bucket, listed over S3's own API, holds exactly the prompts' chunks, each once.
    assert len(node_a.bucket.chunks) == STORED_CHUNKS
    assert listed == prompt_keys([*replicas.prompt_ids, replicas.probe_ids])
    # One engine layout, its manifest stored beside the data.
    assert {k.fingerprint for k in node_a.bucket.chunks} == set(node_a.bucket.manifests)
    assert len(node_a.bucket.manifests) == 1
    assert node_a.bucket.others == []


# -- 2. node B reuses A's chunks from S3 -----------------------------------------------------------
@dataclass
class NodeB:
    answers: list[Completion]
    before: dict[str, Any]
    after: dict[str, Any]
    external_hits: float
    by_tier: dict[str, float]  # what the connector's lookups found, by tier
    l1: list[ObjectKey]
    outages: float  # the times vLLM B's connector found its server unreachable
    warnings: list[str]  # the connector's warnings in vLLM B's log, for a failure's message


@pytest.fixture(scope="module")
def node_b(replicas: Replicas, node_a: NodeA) -> NodeB:
    vllm = replicas.vllm_b
    before = server_stats(replicas.server_b)
    hits_before, tiers_before = vllm.metric(EXTERNAL_HITS), hits_by_tier(vllm)
    answers = replicas.ask(vllm)
    hits, by_tier = vllm.metric(EXTERNAL_HITS) - hits_before, tier_delta(tiers_before, hits_by_tier(vllm))
    return NodeB(
        answers,
        before,
        server_stats(replicas.server_b),
        hits,
        by_tier,
        l1_keys(replicas.server_b),
        vllm.metric(OUTAGES),
        connector_warnings(vllm),
    )


def test_node_b_loads_every_full_chunk_and_answers_as_node_a(node_a: NodeA, node_b: NodeB) -> None:
    cached = [c.cached_tokens for c in node_b.answers]
    diff = max_diff(node_a.answers, node_b.answers)
    print(
        f"\n[replicas B] cached tokens {cached} of {LENGTHS}; {EXTERNAL_HITS} +{node_b.external_hits:g}; "
        f"max |logprob diff| vs A {diff:.3g}; connector outages {node_b.outages:g}"
    )
    assert [c.prompt_tokens for c in node_b.answers] == LENGTHS
    assert cached == EXPECTED_CACHED, "\n".join(node_b.warnings)
    assert node_b.external_hits == sum(EXPECTED_CACHED)  # vLLM's count: from its KV connector
    assert [c.text for c in node_b.answers] == [c.text for c in node_a.answers]
    assert all(len(c.logprobs) == MAX_TOKENS for c in node_b.answers)
    assert diff <= LOGPROB_TOLERANCE


def test_node_b_found_the_chunks_in_s3_only_and_holds_them_in_its_l1(
    replicas: Replicas, node_a: NodeA, node_b: NodeB
) -> None:
    b, a = node_b.before, node_b.after
    per_tier = {t: delta(b, a, "tiers", t, "hits") for t in ("l1", "disk", "s3")}
    print(
        f"\n[replicas B] connector hits by tier {node_b.by_tier}; server: tier hits {per_tier}, "
        f"disk misses {delta(b, a, 'tiers', 'disk', 'misses')}, "
        f"promotions {delta(b, a, 'engine', 'promotions')}, lookups {delta(b, a, 'engine', 'lookups')} "
        f"(tails {delta(b, a, 'engine', 'tail_lookups')}), lookup chunks hit "
        f"{delta(b, a, 'engine', 'lookup_chunks_hit')}, stores {delta(b, a, 'engine', 'stores')}, "
        f"S3 questions past the budget {delta(b, a, 'engine', 'remote_lookups_late')} or refused "
        f"busy {delta(b, a, 'engine', 'remote_lookups_busy')}, S3 errors "
        f"{delta(b, a, 'tiers', 's3', 'errors')} and requests skipped (breaker) "
        f"{delta(b, a, 'tiers', 's3', 'skipped')}; "
        f"L1 objects {a['tiers']['l1']['objects']}, disk objects {a['tiers']['disk']['objects']}"
    )
    # B's server started empty: every chunk it served came from the bucket, its own disk had none.
    assert b["tiers"]["l1"]["objects"] == b["tiers"]["disk"]["objects"] == 0
    assert node_b.by_tier == {"s3": LOADED_CHUNKS}
    assert delta(b, a, "engine", "lookup_chunks_hit") == LOADED_CHUNKS
    assert per_tier["s3"] == LOADED_CHUNKS
    assert per_tier["disk"] == 0
    assert delta(b, a, "engine", "promotions") == LOADED_CHUNKS
    assert delta(b, a, "engine", "promotion_failures") == 0
    assert a["tiers"]["s3"]["verify_failures"] == 0
    # ... and now they are in B's L1: exactly the bucket's objects of these prompts (not the probe's).
    asked = prompt_keys(replicas.prompt_ids)
    in_bucket = sorted(k.text() for k in node_a.bucket.chunks if k.prefix_hash in asked)
    assert len(in_bucket) == PROMPT_CHUNKS
    assert sorted(k.text() for k in node_b.l1) == in_bucket
    # B computed nothing A had stored, so it stored nothing (and wrote nothing to S3).
    assert delta(b, a, "engine", "stores") == 0
    assert delta(b, a, "engine", "l3_writes") == 0


# -- 3. node B's tiercache server restarts on an empty disk and warms from S3 -----------------------
@dataclass
class Warmed:
    warm: dict[str, Any]  # ``tiercache warm --json``
    fresh: dict[str, Any]  # the new server's stats before the warm
    after_warm: dict[str, Any]
    probe: Completion
    outages: list[str]  # the connector's outage warnings since the restart
    before_requests: dict[str, Any]  # after the probe, once the connector is connected again
    after_requests: dict[str, Any]
    answers: list[Completion]
    external_hits: float
    by_tier: dict[str, float]


def run_warm(endpoint: str) -> dict[str, Any]:
    """``tiercache warm --server ENDPOINT --tier s3 --json``, run as the CLI."""
    return cli_json("warm", "--server", endpoint, "--tier", "s3", "--json", timeout=120)


def reset_local_prefix_cache(vllm: OpenAIServer) -> None:
    """vLLM's own prefix cache emptied (dev mode), tiercache's left alone (``reset_external`` off)."""

    def reset() -> bool:
        r = httpx.post(f"{vllm.url}/reset_prefix_cache", timeout=30)
        assert r.status_code == 200, r.text
        return bool(r.json()["success"])  # false while blocks are still held: try again

    wait_until(reset, timeout=30, interval=0.2, what="vLLM's /reset_prefix_cache to succeed")


def outage_lines(vllm: OpenAIServer) -> list[str]:
    return [line for line in vllm.log_text().splitlines() if FAILED_WARNING in line]


def connector_connected(vllm: OpenAIServer) -> bool:
    """Both connector halves are connected: each logged one connect at start and one per outage."""
    log = vllm.log_text()
    return log.count(CONNECTED) == HALVES + log.count(FAILED_WARNING)


@pytest.fixture(scope="module")
def warmed(replicas: Replicas, node_b: NodeB) -> Warmed:
    vllm = replicas.vllm_b
    assert connector_connected(vllm), vllm.log_tail()
    seen = len(outage_lines(vllm))
    replicas.server_b.stop()
    disk = replicas.tmp / "disk-b-fresh"
    assert not disk.exists()
    spec = replicas.node_spec("node-b", disk.name)  # the same endpoint vLLM B's connector names
    replicas.server_b = ServerProcess(spec)
    replicas.server_b.wait_ready()
    fresh = server_stats(replicas.server_b)
    warm = run_warm(spec.listen)
    after_warm = server_stats(replicas.server_b)
    probe = vllm.complete(replicas.probe, MAX_TOKENS)
    wait_until(
        lambda: connector_connected(vllm),
        timeout=30,
        interval=0.1,
        what="vLLM B's connector connected to the restarted server",
    )
    outages = outage_lines(vllm)[seen:]
    reset_local_prefix_cache(vllm)
    before = server_stats(replicas.server_b)
    hits_before, tiers_before = vllm.metric(EXTERNAL_HITS), hits_by_tier(vllm)
    answers = replicas.ask(vllm)
    hits, by_tier = vllm.metric(EXTERNAL_HITS) - hits_before, tier_delta(tiers_before, hits_by_tier(vllm))
    return Warmed(
        warm,
        fresh,
        after_warm,
        probe,
        outages,
        before,
        server_stats(replicas.server_b),
        answers,
        hits,
        by_tier,
    )


def test_warm_promotes_every_chunk_of_the_bucket_into_the_empty_l1(warmed: Warmed) -> None:
    f, w = warmed.fresh, warmed.after_warm
    print(
        f"\n[replicas warm] {json.dumps(warmed.warm)}; server: s3 hits {delta(f, w, 'tiers', 's3', 'hits')}, "
        f"promotions {delta(f, w, 'engine', 'promotions')}, L1 objects {w['tiers']['l1']['objects']}"
    )
    assert f["tiers"]["l1"]["objects"] == f["tiers"]["disk"]["objects"] == 0  # a fresh, empty node
    assert warmed.warm["tier"] == "s3"
    assert warmed.warm["promoted"] == STORED_CHUNKS
    assert warmed.warm["present"] == warmed.warm["failed"] == 0
    assert warmed.warm["bytes"] == w["tiers"]["l1"]["bytes_used"] > 0
    assert w["tiers"]["l1"]["objects"] == STORED_CHUNKS
    assert delta(f, w, "tiers", "s3", "hits") == STORED_CHUNKS
    assert delta(f, w, "engine", "promotions") == STORED_CHUNKS
    assert w["tiers"]["disk"]["objects"] == 0  # a promotion fills L1 only


def test_a_restarted_server_is_no_outage_the_probe_hits_with_node_a_answer(
    node_a: NodeA, warmed: Warmed
) -> None:
    print(
        f"\n[replicas probe] cached tokens {warmed.probe.cached_tokens} of {PROBE_LENGTH}; "
        f"connector outages since the restart: {len(warmed.outages)}"
        + "".join(f"\n  {line}" for line in warmed.outages)
    )
    assert warmed.outages == []
    assert warmed.probe.prompt_tokens == PROBE_LENGTH
    assert warmed.probe.cached_tokens == PROBE_LENGTH // CHUNK * CHUNK
    assert warmed.probe.text == node_a.probe.text
    assert warmed.probe.max_logprob_diff(node_a.probe) <= LOGPROB_TOLERANCE


def test_after_the_warm_every_full_chunk_hits_from_l1_with_node_a_answers(
    node_a: NodeA, warmed: Warmed
) -> None:
    b, r = warmed.before_requests, warmed.after_requests
    cached = [c.cached_tokens for c in warmed.answers]
    diff = max_diff(node_a.answers, warmed.answers)
    per_tier = {t: delta(b, r, "tiers", t, "hits") for t in ("l1", "disk", "s3")}
    print(
        f"\n[replicas warm] cached tokens {cached}; {EXTERNAL_HITS} +{warmed.external_hits:g}; "
        f"connector hits by tier {warmed.by_tier}; server: tier hits "
        f"{per_tier}, s3 misses {delta(b, r, 'tiers', 's3', 'misses')}, promotions "
        f"{delta(b, r, 'engine', 'promotions')}, lookup chunks hit "
        f"{delta(b, r, 'engine', 'lookup_chunks_hit')}, stores {delta(b, r, 'engine', 'stores')}; "
        f"max |logprob diff| vs A {diff:.3g}"
    )
    assert cached == EXPECTED_CACHED
    assert warmed.external_hits == sum(EXPECTED_CACHED)
    assert [c.text for c in warmed.answers] == [c.text for c in node_a.answers]
    assert all(len(c.logprobs) == MAX_TOKENS for c in warmed.answers)
    assert diff <= LOGPROB_TOLERANCE
    # Served from L1: every chunk hit there, nothing promoted, nothing read from the (empty) disk or
    # from S3 while answering, and nothing stored.
    assert warmed.by_tier == {"l1": LOADED_CHUNKS}
    assert delta(b, r, "engine", "lookup_chunks_hit") == LOADED_CHUNKS
    assert per_tier["l1"] == LOADED_CHUNKS
    assert per_tier["s3"] == per_tier["disk"] == 0
    assert delta(b, r, "tiers", "s3", "misses") == delta(b, r, "tiers", "disk", "misses") == 0
    assert delta(b, r, "engine", "promotions") == 0
    assert delta(b, r, "engine", "stores") == 0
