"""Specification: `tiercache inspect` reads a disk path or an S3 prefix strictly read-only.

Offline there are no counters (they live in a server's memory), so ``explain`` says where a chunk is,
that it is under another fingerprint, or that it was never stored — never why it was evicted.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import boto3
import pytest

from tests.cli.conftest import one_line
from tests.cli.test_inspect import prompt_tokens
from tests.conftest import FakeClock, S3Endpoint
from tests.l3_s3.helpers import BUCKET, make_s3_tier
from tests.server.conftest import manifest
from tests.server.serverproc import ServerProcess, ServerSpec
from tests.server.test_data_path import store_prompt
from tiercache.cli.app import main
from tiercache.config import DiskConfig, S3Config
from tiercache.keys import ObjectKey, chunk_hashes
from tiercache.l2_disk import DiskTier
from tiercache.l2_disk.reader import DiskReader
from tiercache.l3_s3.reader import READ_OPERATIONS, S3Reader
from tiercache.testing.poll import wait_until

KiB = 1 << 10
A = manifest()
B = manifest(kv_dtype="fp8")


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    code = main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def snapshot(path: Path) -> dict[str, tuple[int, int, str]]:
    """Size, mtime and content hash of data.mdb (the reader may only take a slot in lock.mdb)."""
    f = path / "data.mdb"
    st = f.stat()
    return {"data.mdb": (st.st_size, st.st_mtime_ns, hashlib.sha256(f.read_bytes()).hexdigest())}


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    """A disk tier written by DiskTier and closed: prompt (3 chunks) under A, its 2nd chunk under B."""
    path = tmp_path / "disk"
    tier = DiskTier(DiskConfig(path=path, budget_bytes=64 * (1 << 20)))
    try:
        hashes = chunk_hashes(prompt_tokens(3), 256)
        for fp_m in (A, B):
            tier.put_manifest(fp_m.fingerprint(), fp_m.canonical())
        for h in hashes:
            tier.put(ObjectKey(A.fingerprint(), 0, h), b"x" * 4096)
        tier.put(ObjectKey(B.fingerprint(), 1, hashes[1]), b"y" * 1000)
    finally:
        tier.close()
    return path


def test_disk_summary_keys_and_fingerprints_modify_nothing(
    disk: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(disk)
    summary = run_json(capsys, "inspect", "summary", "--disk-path", str(disk))
    assert summary["source"] == "offline"
    assert summary["tiers"]["disk"] == {
        "bytes_used": 3 * 4096 + 1000,
        "bytes_budget": None,
        "objects": 4,
        "fingerprints": 2,
    }

    keys = run_json(capsys, "inspect", "keys", "--disk-path", str(disk), "--limit", "2")
    assert len(keys["keys"]) == 2 and keys["next_cursor"]
    rest = run_json(capsys, "inspect", "keys", "--disk-path", str(disk), "--cursor", keys["next_cursor"])
    assert len(rest["keys"]) == 2 and rest["next_cursor"] is None
    assert all(k["tiers"] == ["disk"] for k in keys["keys"] + rest["keys"])
    only_b = run_json(
        capsys,
        "inspect",
        "keys",
        "--disk-path",
        str(disk),
        "--fingerprint",
        B.fingerprint().hex,
        "--group",
        "1",
    )
    assert [k["key"].split("/")[:2] for k in only_b["keys"]] == [[B.fingerprint().hex, "g1"]]

    rows = run_json(capsys, "inspect", "fingerprints", "--disk-path", str(disk))["fingerprints"]
    assert {r["fingerprint"]: r["manifest"]["kv_dtype"] for r in rows} == {
        A.fingerprint().hex: "bfloat16",
        B.fingerprint().hex: "fp8",
    }
    assert main(["inspect", "summary", "--disk-path", str(disk)]) == 0
    assert "stored data only" in capsys.readouterr().out
    assert snapshot(disk) == before


def test_disk_explain_needs_a_chunk_size_and_finds_other_fingerprints(
    disk: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    tokens = tmp_path / "t.json"
    tokens.write_text(json.dumps(prompt_tokens(4)))
    before = snapshot(disk)
    data = run_json(
        capsys,
        "inspect",
        "explain",
        str(tokens),
        "--disk-path",
        str(disk),
        "--chunk-size",
        "256",
        "--fingerprint",
        B.fingerprint().hex,
        "--group",
        "0",
        "--group",
        "1",
    )
    by = {(e["object_group"], e["chunk"]): e for e in data["entries"]}
    assert by[(1, 1)]["status"] == "disk"
    assert (
        by[(0, 0)]["status"] == "other_fingerprint" and by[(0, 0)]["other_fingerprint"] == A.fingerprint().hex
    )
    assert by[(0, 3)]["status"] == "never_stored"
    assert by[(1, 0)]["status"] == "never_stored"

    data = run_json(
        capsys,
        "inspect",
        "explain",
        str(tokens),
        "--disk-path",
        str(disk),
        "--chunk-size",
        "256",
        "--fingerprint",
        A.fingerprint().hex,
    )
    assert [e["status"] for e in data["entries"]] == ["disk", "disk", "disk", "never_stored"]
    assert data["prefix_chunks"] == 3
    assert snapshot(disk) == before


def test_a_missing_disk_path_is_one_line_exit_1(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(["inspect", "summary", "--disk-path", str(tmp_path / "nope")])
    _, err = capsys.readouterr()
    assert code == 1
    assert "--disk-path" in one_line(err) and str(tmp_path / "nope") in err
    assert not (tmp_path / "nope").exists()  # never created


def test_watch_needs_a_live_server(disk: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["inspect", "summary", "--disk-path", str(disk), "--watch"])
    assert code == 2
    assert "--watch needs a live server" in one_line(capsys.readouterr().err)


def test_disk_inspected_while_a_server_has_it_open(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "disk"
    proc = ServerProcess(ServerSpec(listen=f"ipc://{tmp_path}/s.sock", disk_path=str(path)))
    try:
        proc.wait_ready()
        with proc.client() as client:
            [group] = client.register([(0, A)])
            store_prompt(client, group, chunk_hashes(prompt_tokens(5), 256), nbytes=8 * KiB)
            # The write-through to disk is asynchronous.
            wait_until(
                lambda: client.stats()["tiers"]["disk"]["objects"] >= 5, what="the write-through to disk"
            )
            served = client.stats()["tiers"]["disk"]
            assert served["objects"] == 5
            size_before = (path / "data.mdb").stat().st_size

            summary = run_json(capsys, "inspect", "summary", "--disk-path", str(path))
            assert summary["tiers"]["disk"]["objects"] == 5
            assert summary["tiers"]["disk"]["bytes_used"] == served["bytes_used"]
            keys = run_json(capsys, "inspect", "keys", "--disk-path", str(path))
            assert len(keys["keys"]) == 5
            rows = run_json(capsys, "inspect", "fingerprints", "--disk-path", str(path))["fingerprints"]
            assert [r["fingerprint"] for r in rows] == [A.fingerprint().hex]

            after = client.stats()["tiers"]["disk"]  # the server still answers and holds the same
            assert (after["objects"], after["bytes_used"]) == (5, served["bytes_used"])
            assert (path / "data.mdb").stat().st_size == size_before
    finally:
        proc.stop()


def test_the_disk_reader_refuses_nothing_it_does_not_have(tmp_path: Path) -> None:
    import lmdb

    path = tmp_path / "disk"
    DiskTier(DiskConfig(path=path, budget_bytes=1 << 20)).close()
    with DiskReader(path) as reader:
        assert not hasattr(reader, "put") and not hasattr(reader, "delete")
        with pytest.raises(lmdb.ReadonlyError), reader._env.begin(write=True) as txn:
            txn.put(b"k", b"v")


# -- S3 --------------------------------------------------------------------------------------------


def s3_args(s3: S3Endpoint) -> list[str]:
    return [
        "--s3-bucket",
        BUCKET,
        "--s3-prefix",
        "tc",
        "--s3-endpoint-url",
        s3.url,
        "--s3-region",
        s3.region,
        "--s3-path-style",
    ]


def listing(s3: S3Endpoint) -> list[tuple[str, str, Any]]:
    client = boto3.client("s3", endpoint_url=s3.url, region_name=s3.region)
    page = client.list_objects_v2(Bucket=BUCKET)
    return sorted((o["Key"], o["ETag"], o["LastModified"]) for o in page.get("Contents", ()))


@pytest.fixture
def s3_stored(s3: S3Endpoint) -> S3Endpoint:
    """An S3 prefix written by S3Tier: 3 chunks under A and the manifests of A and B."""
    tier = make_s3_tier(s3, FakeClock())
    try:
        for m in (A, B):
            tier.put_manifest(m.fingerprint(), m.canonical())
        for h in chunk_hashes(prompt_tokens(3), 256):
            tier.put(ObjectKey(A.fingerprint(), 0, h), b"z" * 2048)
    finally:
        tier.close()
    return s3


def test_s3_summary_keys_fingerprints_and_explain_change_nothing(
    s3_stored: S3Endpoint, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    before = listing(s3_stored)
    args = s3_args(s3_stored)
    summary = run_json(capsys, "inspect", "summary", *args)
    assert summary["tiers"]["s3"]["objects"] == 3 and summary["tiers"]["s3"]["fingerprints"] == 2
    assert f"s3://{BUCKET}/tc" in summary["where"]
    keys = run_json(capsys, "inspect", "keys", *args)
    assert len(keys["keys"]) == 3 and all(k["tiers"] == ["s3"] for k in keys["keys"])
    rows = run_json(capsys, "inspect", "fingerprints", *args)["fingerprints"]
    assert {r["fingerprint"] for r in rows} == {A.fingerprint().hex, B.fingerprint().hex}

    tokens = tmp_path / "t.txt"
    tokens.write_text(" ".join(map(str, prompt_tokens(3))))
    data = run_json(capsys, "inspect", "explain", str(tokens), *args, "--chunk-size", "256")
    by = {(e["fingerprint"], e["chunk"]): e["status"] for e in data["entries"]}
    assert by[(A.fingerprint().hex, 0)] == "s3"
    assert by[(B.fingerprint().hex, 0)] == "other_fingerprint"
    assert listing(s3_stored) == before


def test_the_s3_reader_only_lists_and_gets(s3_stored: S3Endpoint) -> None:
    cfg = S3Config(
        bucket=BUCKET, prefix="tc", endpoint_url=s3_stored.url, region=s3_stored.region, path_style=True
    )
    with S3Reader(cfg) as reader:
        ops: list[str] = []
        reader.client.meta.events.register("before-call.s3", lambda model, **_: ops.append(model.name))
        assert reader.usage().objects == 3
        assert len(list(reader.iter_manifests())) == 2
        assert reader.get_manifest(A.fingerprint()) == A.canonical()
        assert set(ops) <= READ_OPERATIONS and "ListObjectsV2" in ops


def test_a_missing_bucket_is_one_line_exit_1_without_credentials(
    s3: S3Endpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    url = s3.url.replace("http://", "http://user:pa55w0rd@")
    code = main(
        [
            "inspect",
            "summary",
            "--s3-bucket",
            "nope",
            "--s3-endpoint-url",
            url,
            "--s3-region",
            s3.region,
            "--s3-path-style",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    line = one_line(err)
    assert "'nope'" in line and "pa55w0rd" not in line
