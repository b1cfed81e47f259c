"""The dense model across server restarts: hits from L2 (LMDB) after a restart, from L3 (S3, moto over
real HTTP) after L2 was wiped, and a corrupted chunk in L2 that must miss, never load.

One cold engine run stores through a server with L2 and L3; every later engine is fresh (its own
process) and talks to a *new* server process whose L1 is empty, so each hit comes from a lower tier.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.conftest import S3Endpoint
from tests.e2e.engine_run import write_tiny_llama
from tests.e2e.setup import (
    PATIENT_LOOKUPS,
    PATIENT_S3,
    MiB,
    Run,
    Setup,
    cold_setup,
    engine_stats,
    wait_for,
    wait_for_stores,
)
from tests.e2e.test_dense import CHUNK, EXPECTED_CACHED, LENGTHS, STORED_CHUNKS
from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.keys import ExtraKeys, ObjectKey, PrefixHasher

pytestmark = pytest.mark.e2e

CORRUPT_PROMPT, CORRUPT_CHUNK = 0, 1  # prompt 0 (200 tokens, 3 chunks): chunk 1 of 0..2


@dataclass(kw_only=True)
class RestartSetup(Setup):
    """The cold run through a server with L2 and L3 (stopped since), and where its tiers are."""

    s3_url: str
    bucket: str
    corrupt_target: bytes  # the stored object of (CORRUPT_PROMPT, CORRUPT_CHUNK)


def _spec(setup_tmp: Path, name: str, disk: Path, s3_url: str | None, bucket: str) -> ServerSpec:
    return ServerSpec(
        listen=f"ipc://{setup_tmp}/{name}.sock",
        l1_bytes=64 * MiB,
        disk_path=str(disk),
        disk_budget=64 * MiB,
        s3_url=s3_url,
        s3_bucket=bucket,
        options={"chunk_size": CHUNK},
        s3_options={**PATIENT_S3},  # a hit from S3 is the claim, not its speed
        engine_options={**PATIENT_LOOKUPS},
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Endpoint) -> Iterator[RestartSetup]:
    tmp = tmp_path_factory.mktemp("e2e-restart")
    bucket = f"e2e-restart-{uuid.uuid4().hex[:8]}"
    with cold_setup(
        tmp,
        write_tiny_llama,
        LENGTHS,
        chunk=CHUNK,
        spec=_spec(tmp, "first", tmp / "l2", s3_server.url, bucket),
    ) as base:
        assert wait_for_stores(base.server, STORED_CHUNKS) == STORED_CHUNKS
        assert wait_for(base.server, "l2_writes", STORED_CHUNKS) == STORED_CHUNKS
        assert wait_for(base.server, "l3_writes", STORED_CHUNKS) == STORED_CHUNKS
        target = PrefixHasher(CHUNK, ExtraKeys()).update(base.prompt_ids[CORRUPT_PROMPT])[CORRUPT_CHUNK]
        with base.server.client() as c:
            keys, _ = c.list_keys(tier="l1")
            [key] = [
                ObjectKey.from_bytes(k.key) for k in keys if ObjectKey.from_bytes(k.key).prefix_hash == target
            ]
            data = c.get(key)
            assert data is not None
    # The first server is stopped: every later engine talks to a new one whose L1 is empty.
    yield RestartSetup.of(base, s3_url=s3_server.url, bucket=bucket, corrupt_target=data)


def _warm(setup: RestartSetup, name: str, disk: Path, s3: bool) -> tuple[Run, dict[str, int]]:
    server = ServerProcess(_spec(setup.tmp, name, disk, setup.s3_url if s3 else None, setup.bucket))
    try:
        server.wait_ready()
        run = setup.run(name, server=server.endpoint)
        return run, engine_stats(server)
    finally:
        server.stop()


def _assert_hits_promoted_and_output_matches(
    setup: RestartSetup, tier: str, warm: Run, stats: dict[str, int]
) -> None:
    """The fresh engine hit every chunk it may, each promoted from ``tier`` into the new server's
    empty L1, and reproduced the cold run."""
    diff = warm.max_logprob_diff(setup.cold)
    print(
        f"\n[e2e restart {tier}] cached tokens {warm.num_cached}, chunk hits {stats['lookup_chunks_hit']}, "
        f"promotions {stats['promotions']}, max |logprob diff| {diff:.3g}"
    )
    assert warm.num_cached == EXPECTED_CACHED
    assert stats["promotions"] >= sum(EXPECTED_CACHED) // CHUNK
    assert warm.tokens == setup.cold.tokens
    assert diff <= 1e-5


def test_restarted_server_serves_hits_from_l2(setup: RestartSetup) -> None:
    warm, stats = _warm(setup, "restart-l2", setup.tmp / "l2", s3=False)
    _assert_hits_promoted_and_output_matches(setup, "L2", warm, stats)


def test_wiped_l2_serves_hits_from_s3(setup: RestartSetup) -> None:
    fresh = setup.tmp / "l2-wiped"
    shutil.rmtree(fresh, ignore_errors=True)
    warm, stats = _warm(setup, "restart-l3", fresh, s3=True)
    _assert_hits_promoted_and_output_matches(setup, "L3", warm, stats)


def test_corrupted_chunk_in_l2_misses_from_there_on(setup: RestartSetup) -> None:
    """Flip bytes of one stored chunk inside LMDB's data.mdb (server stopped): that chunk and the
    later ones of its prompt miss (the disk tier's checksum catches it), the output is the cold run's."""
    mdb = next((setup.tmp / "l2").rglob("data.mdb"))
    raw = bytearray(mdb.read_bytes())
    # A probe from the *last* layer's pages: layer 0's KV of a token depends only on the token and its
    # position, so another prompt with the same token at the same position holds the same bytes there.
    # Flip every copy found (an LMDB free page may still hold an old one; it is never read).
    half = len(setup.corrupt_target) // 2  # 2 layers, layer-major
    probe = setup.corrupt_target[half + 4096 : half + 4096 + 256]
    hits, at = 0, raw.find(probe)
    while at >= 0:
        for i in range(at, at + len(probe)):
            raw[i] ^= 0xFF
        hits, at = hits + 1, raw.find(probe, at + len(probe))
    assert hits >= 1, "the chunk's bytes are not stored verbatim in data.mdb"
    mdb.write_bytes(bytes(raw))
    warm, stats = _warm(setup, "corrupt-l2", setup.tmp / "l2", s3=False)
    diff = warm.max_logprob_diff(setup.cold)
    print(
        f"\n[e2e corrupt L2 chunk] cached tokens {warm.num_cached}, chunk hits {stats['lookup_chunks_hit']}, "
        f"max |logprob diff| {diff:.3g}"
    )
    expected = list(EXPECTED_CACHED)
    expected[CORRUPT_PROMPT] = CORRUPT_CHUNK * CHUNK
    assert warm.num_cached == expected
    assert warm.tokens == setup.cold.tokens
    assert diff <= 1e-5
