"""Specification: `tiercache inspect` against a live server process tells what is stored and why not.

One server process (own process, ipc socket) is populated once for the module:

* prompt P (12 chunks x 128 KiB) under layout A, stored one chunk at a time into a 1 MiB arena, so its
  first chunks are evicted for capacity;
* prompt Q (2 chunks) under layout B (same model, fp8 KV: another fingerprint);
* prompt R (3 chunks) under layout A, stored last: a restorable prefix.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cli.conftest import one_line
from tests.server.conftest import manifest
from tests.server.serverproc import ServerProcess, ServerSpec
from tests.server.test_data_path import store_prompt
from tiercache.cli.app import main
from tiercache.keys import Fingerprint, chunk_hashes
from tiercache.wire.protocol import GroupRef

pytest.importorskip("tiercache.server")

KiB = 1 << 10
SECRET = "s3cr3t-inspect-never-shown"


def prompt_tokens(n_chunks: int, seed: int = 0) -> list[int]:
    """The tokens whose chunk hashes tests.server.test_data_path.prompt_hashes stores."""
    return [(seed * 7919 + i) % 32000 for i in range(n_chunks * 256)]


def hashes_of(tokens: list[int]) -> list[bytes]:
    return chunk_hashes(tokens, 256)


class Live:
    def __init__(self, proc: ServerProcess, a: GroupRef, b: GroupRef) -> None:
        self.proc = proc
        self.endpoint = proc.endpoint
        self.a = Fingerprint(a.fingerprint).hex
        self.b = Fingerprint(b.fingerprint).hex


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("inspect-live")
    proc = ServerProcess(
        ServerSpec(listen=f"ipc://{tmp}/server.sock", l1_bytes=1024 * KiB, options={"chunk_size": 256})
    )
    try:
        proc.wait_ready()
        with proc.client() as client:
            a, b = client.register([(0, manifest())]) + client.register([(0, manifest(kv_dtype="fp8"))])
            for h in hashes_of(prompt_tokens(12)):  # 12 x 128 KiB through a 1 MiB arena: the oldest go
                store_prompt(client, a, [h], nbytes=128 * KiB)
            store_prompt(client, b, hashes_of(prompt_tokens(2, seed=3)), nbytes=4 * KiB)
            store_prompt(client, a, hashes_of(prompt_tokens(3, seed=5)), nbytes=4 * KiB)
        yield Live(proc, a, b)
    finally:
        proc.stop()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


# -- summary ---------------------------------------------------------------------------------------


def test_summary_json_reports_usage_hit_rate_and_evictions_per_tier(
    live: Live, capsys: pytest.CaptureFixture[str]
) -> None:
    data = run_json(capsys, "inspect", "summary", "--server", live.endpoint)
    assert data["source"] == "server" and data["where"] == live.endpoint and data["format"] == 1
    l1 = data["tiers"]["l1"]
    assert l1["bytes_budget"] == 1024 * KiB and 0 < l1["bytes_used"] <= l1["bytes_budget"]
    assert l1["evictions"]["capacity"] >= 4
    assert "hit_rate" in l1 and "verify_failures" in l1 and "errors" in l1
    assert {"l2_queue_drops", "l3_queue_drops", "stores_dropped"} <= set(data["engine"])
    keys = run_json(capsys, "inspect", "keys", "--server", live.endpoint, "--limit", "1000")
    assert l1["objects"] == len(keys["keys"])


def test_summary_table_names_each_tier_and_the_engine_counters(
    live: Live, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "inspect", "summary", "--server", live.endpoint)
    assert code == 0, err
    assert live.endpoint in out
    assert "l1" in out and "hit rate" in out and "capacity" in out
    assert "queue drops" in out


def test_watch_refreshes_until_ctrl_c_and_exits_0(
    live: Live, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import tiercache.cli.inspect as ci

    ticks = iter([None])

    def sleep(_s: float) -> None:
        if next(ticks, "stop") == "stop":
            raise KeyboardInterrupt

    monkeypatch.setattr(ci.time, "sleep", sleep)
    code, out, _ = run(capsys, "inspect", "summary", "--server", live.endpoint, "--watch", "0.5")
    assert code == 0 and "l1" in out

    ticks = iter([None])
    code, out, _ = run(capsys, "inspect", "summary", "--server", live.endpoint, "--watch", "--json")
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["source"] == "server" for line in lines)


# -- keys ------------------------------------------------------------------------------------------


def test_keys_pages_with_a_cursor_until_the_last_page(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    everything = run_json(capsys, "inspect", "keys", "--server", live.endpoint, "--limit", "1000")
    assert everything["next_cursor"] is None
    assert len(everything["keys"]) > 3  # several pages of 3 below, or the paging is never tested
    seen: list[str] = []
    cursor = ""
    while True:
        page = run_json(
            capsys, "inspect", "keys", "--server", live.endpoint, "--limit", "3", "--cursor", cursor
        )
        assert len(page["keys"]) <= 3
        seen += [k["key"] for k in page["keys"]]
        if page["next_cursor"] is None:
            break
        cursor = page["next_cursor"]
    assert seen == [k["key"] for k in everything["keys"]]
    assert all(k["tiers"] == ["l1"] for k in everything["keys"])


def test_keys_filter_by_fingerprint_group_and_tier(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    only_b = run_json(capsys, "inspect", "keys", "--server", live.endpoint, "--fingerprint", live.b)
    assert len(only_b["keys"]) == 2 and all(k["key"].startswith(live.b + "/g0/") for k in only_b["keys"])
    assert run_json(capsys, "inspect", "keys", "--server", live.endpoint, "--group", "7")["keys"] == []
    assert len(run_json(capsys, "inspect", "keys", "--server", live.endpoint, "--tier", "l1")["keys"]) > 2

    code, _, err = run(capsys, "inspect", "keys", "--server", live.endpoint, "--tier", "tape")
    assert code == 2 and "tape" in one_line(err)


def test_keys_table_shows_the_key_parts_and_how_to_continue(
    live: Live, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "inspect", "keys", "--server", live.endpoint, "--limit", "2")
    assert code == 0
    assert "prefix hash" in out and "more: --cursor " in out


# -- fingerprints ----------------------------------------------------------------------------------


def test_fingerprints_show_each_layout_manifest(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "inspect", "fingerprints", "--server", live.endpoint)
    rows = {r["fingerprint"]: r for r in data["fingerprints"]}
    assert set(rows) == {live.a, live.b}
    assert rows[live.b]["manifest"]["kv_dtype"] == "fp8" and rows[live.b]["objects"] == 2
    assert rows[live.a]["manifest"]["kv_dtype"] == "bfloat16" and rows[live.a]["groups"] == {
        "0": rows[live.a]["objects"]
    }

    code, out, _ = run(capsys, "inspect", "fingerprints", "--server", live.endpoint)
    assert code == 0
    for text in ("tiny-llama", "fp8", "bfloat16", "TORCH_SDPA", "page bytes", "TP size/rank", live.a, live.b):
        assert text in out


# -- explain ---------------------------------------------------------------------------------------


def test_explain_from_a_file_finds_the_stored_prefix(
    live: Live, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    tokens = tmp_path / "prompt.txt"
    tokens.write_text(", ".join(map(str, prompt_tokens(4, seed=5))) + "\n")  # R's 3 chunks and one more
    data = run_json(
        capsys, "inspect", "explain", str(tokens), "--server", live.endpoint, "--fingerprint", live.a
    )
    assert data["chunk_size"] == 256 and data["chunks"] == 4 and data["tokens"] == 1024
    assert [e["status"] for e in data["entries"]] == ["l1", "l1", "l1", "never_stored"]
    assert data["prefix_chunks"] == 3

    code, out, _ = run(
        capsys, "inspect", "explain", str(tokens), "--server", live.endpoint, "--fingerprint", live.a
    )
    assert code == 0
    assert "never stored" in out and "restorable prefix: 3 of 4 chunk(s)" in out


def test_explain_from_stdin_names_evictions_and_other_fingerprints(
    live: Live, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(prompt_tokens(12))))
    data = run_json(capsys, "inspect", "explain", "--server", live.endpoint)  # every known fingerprint
    assert {(g["fingerprint"], g["object_group"]) for g in data["groups"]} == {(live.a, 0), (live.b, 0)}
    by = {(e["fingerprint"], e["chunk"]): e for e in data["entries"]}
    first = by[(live.a, 0)]
    assert (first["status"], first["tier"], first["reason"]) == ("evicted", "l1", "capacity")
    assert first["age_s"] >= 0
    assert by[(live.a, 11)]["status"] == "l1"
    other = by[(live.b, 11)]
    assert other["status"] == "other_fingerprint" and other["other_fingerprint"] == live.a
    assert data["prefix_chunks"] == 0


def test_explain_with_a_cache_salt_hashes_other_chunks(
    live: Live, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    tokens = tmp_path / "prompt.txt"
    tokens.write_text(" ".join(map(str, prompt_tokens(3, seed=5))))
    data = run_json(
        capsys,
        "inspect",
        "explain",
        str(tokens),
        "--server",
        live.endpoint,
        "--fingerprint",
        live.a,
        "--cache-salt",
        "tenant-1",
        "--chunk-size",
        "256",
    )
    assert [e["status"] for e in data["entries"]] == ["never_stored"] * 3


def test_explain_of_an_unknown_fingerprint_is_a_usage_error(
    live: Live, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    tokens = tmp_path / "prompt.txt"
    tokens.write_text(" ".join(["7"] * 300))
    code, _, err = run(
        capsys, "inspect", "explain", str(tokens), "--server", live.endpoint, "--fingerprint", "ab" * 16
    )
    assert code == 2 and "ab" * 16 in one_line(err)


# -- errors ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_server_is_one_line_naming_the_endpoint_exit_1(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = f"ipc://{tmp_path}/nobody.sock"
    code, out, err = run(capsys, "inspect", "summary", "--server", missing)
    assert code == 1 and out == ""
    line = one_line(err)
    assert missing in line and "tiercache server" in line

    tcp = f"tcp://127.0.0.1:{free_port()}"
    code, out, err = run(
        capsys, "inspect", "keys", "--server", tcp, "--auth-secret", SECRET, "--timeout", "0.3"
    )
    assert code == 1 and out == ""
    line = one_line(err)
    assert tcp in line and "--auth-secret" in line and SECRET not in line


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["keys", "--limit", "0"], "--limit 0"),
        (["keys", "--fingerprint", "zz"], "--fingerprint 'zz'"),
        (["keys", "--cursor", "xyz"], "--cursor"),
        (["summary", "--server", "http://host:1"], "--server 'http://host:1'"),
        (["summary", "--s3-prefix", "p"], "--s3-prefix needs --s3-bucket"),
        (["summary", "--server", "ipc:///x", "--disk-path", "/x"], "exclude each other"),
        (["explain", "--disk-path", "/nonexistent"], "--chunk-size is required offline"),
        (["summary", "--bogus"], "unrecognized arguments: --bogus"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, out, err = run(capsys, "inspect", *argv)
    assert code == 2 and out == ""
    assert needle in one_line(err)


@pytest.mark.parametrize("text", ["1 2 x3", "[1, 2.5]", "", "[1, -1]", '{"a": 1}'])
def test_bad_token_files_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str
) -> None:
    tokens = tmp_path / "t.txt"
    tokens.write_text(text)
    code, _, err = run(capsys, "inspect", "explain", str(tokens), "--server", f"ipc://{tmp_path}/none.sock")
    assert code == 2
    assert str(tokens) in one_line(err)


def test_a_shared_secret_server_is_inspected_without_ever_showing_the_secret(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    proc = ServerProcess(ServerSpec(listen=endpoint, options={"chunk_size": 256, "auth_secret": SECRET}))
    try:
        proc.wait_ready(auth_secret=SECRET)
        code, out, err = run(capsys, "inspect", "summary", "--server", endpoint, "--auth-secret", SECRET)
        assert code == 0 and SECRET not in out + err
        monkeypatch.setenv("TIERCACHE_AUTH_SECRET", SECRET)
        code, out, err = run(capsys, "inspect", "fingerprints", "--server", endpoint, "--json")
        assert code == 0 and SECRET not in out + err
        monkeypatch.delenv("TIERCACHE_AUTH_SECRET")
        code, out, err = run(
            capsys, "inspect", "summary", "--server", endpoint, "--auth-secret", SECRET + "-wrong"
        )
        assert code == 1 and SECRET not in out + err
        assert one_line(err).startswith("tiercache: AuthenticationError")
    finally:
        proc.stop()


# -- the real entry point --------------------------------------------------------------------------


def entry_point() -> list[str]:
    script = Path(sys.executable).with_name("tiercache")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tiercache.cli"]


def test_the_console_script_prints_json_and_one_line_errors(live: Live, tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    proc = subprocess.run(
        [*entry_point(), "inspect", "summary", "--server", live.endpoint, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tiers"]["l1"]["objects"] > 0

    proc = subprocess.run(
        [*entry_point(), "inspect", "summary"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert proc.returncode == 1
    line = one_line(proc.stderr)
    assert f"unix://{tmp_path}/run/tiercache/server.sock" in line
