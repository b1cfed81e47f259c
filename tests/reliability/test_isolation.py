"""Scenario: isolation and access — salts, file modes, and credentials that never show.

* Chunks stored under one cache salt are never hits for another salt with the same tokens (end to
  end: hashes built per salt, stored and looked up through a client and a real server).
* The ipc socket, the LMDB directory and files and the L1 arena in /dev/shm are owner-only.
* A real ``tiercache server`` process with S3 credentials in its environment, at ``--log-level
  debug``, through S3 failures, plus ``tiercache inspect`` (live and offline on the bucket) and a bad
  flag: no output line contains the access key id or the secret key.

Covered elsewhere and not repeated here: TCP refuses unauthenticated clients (shared secret and
CURVE) in tests/server/test_security.py; the endpoint URL's user-info never reaching messages in
tests/l3_s3/test_s3_tier.py; ``--auth-secret`` never printed in tests/cli/test_server_process.py.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import S3Endpoint
from tests.reliability.common import FaultyS3Proxy, figures, payload
from tests.server.conftest import StartServer, manifest
from tiercache.client.client import Client
from tiercache.errors import ServerUnavailableError
from tiercache.keys import ExtraKeys, ObjectKey, chunk_hashes
from tiercache.keys.fingerprint import Fingerprint
from tiercache.testing.poll import wait_until
from tiercache.wire.protocol import TicketStateName

KiB = 1 << 10
TOKENS = [(i * 31) % 32000 for i in range(8 * 256)]
ACCESS_KEY = "AKIARELIABILITYTEST7"
SECRET_KEY = "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"


def test_chunks_stored_under_one_salt_are_never_hits_for_another(start_server: StartServer) -> None:
    server = start_server()
    salts = ["tenant-a", "tenant-b", ""]
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        fp = Fingerprint(group.fingerprint)
        per_salt = {s: chunk_hashes(TOKENS, 256, ExtraKeys(cache_salt=s)) for s in salts}
        stored = per_salt["tenant-a"]
        keys = [ObjectKey(fp, 0, h) for h in stored]
        assert client.store_chunks(keys, [payload(k, 4 * KiB) for k in keys]) == len(keys)
        found = {s: client.lookup(per_salt[s], [group], prefetch=False).chunks for s in salts}
        shared = len(set(per_salt["tenant-a"]) & (set(per_salt["tenant-b"]) | set(per_salt[""])))
        own = client.lookup(stored, [group])
        assert own.state is TicketStateName.READY
        wrong = sum(v != payload(k, 4 * KiB) for k, v in client.read_ticket(own).items())
    figures(
        "salt-isolation",
        chunks_stored=len(keys),
        hits_same_salt=found["tenant-a"],
        hits_other_salt=found["tenant-b"],
        hits_no_salt=found[""],
        shared_hashes=shared,
        wrong_reads=wrong,
    )
    assert found == {"tenant-a": 8, "tenant-b": 0, "": 0}
    assert shared == 0 and wrong == 0


def test_socket_data_files_and_arena_are_owner_only(start_server: StartServer, tmp_path: Path) -> None:
    server = start_server(disk_path=str(tmp_path / "disk"))
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        key = ObjectKey(Fingerprint(group.fingerprint), 0, b"h" * 16)
        client.store_chunks([key], [b"x" * 4096])
        arena = Path("/dev/shm") / client.server.arena_name
        wait_until(lambda: client.stats()["engine"]["l2_writes"] == 1, timeout=10, what="the disk write")
        modes = {
            "socket": os.stat(server.endpoint.removeprefix("ipc://")).st_mode,
            "socket dir": os.stat(Path(server.endpoint.removeprefix("ipc://")).parent).st_mode,
            "disk dir": os.stat(tmp_path / "disk").st_mode,
            "arena": arena.stat().st_mode,
            **{f"disk/{p.name}": p.stat().st_mode for p in (tmp_path / "disk").iterdir()},
        }
    figures("owner-only", **{k.replace(" ", "_"): oct(stat.S_IMODE(m)) for k, m in modes.items()})
    for what, mode in modes.items():
        assert stat.S_IMODE(mode) & 0o077 == 0, f"{what} is {oct(stat.S_IMODE(mode))}"


def test_s3_credentials_never_appear_in_logs_errors_or_inspect(s3: S3Endpoint, tmp_path: Path) -> None:
    proxy = FaultyS3Proxy(s3.url)
    log = open(tmp_path / "server.log", "w")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIERCACHE_", "AWS_"))}
    env.update(
        AWS_ACCESS_KEY_ID=ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=SECRET_KEY,
        AWS_DEFAULT_REGION="us-east-1",
        XDG_RUNTIME_DIR=str(tmp_path / "run"),
        XDG_DATA_HOME=str(tmp_path / "data"),
    )
    listen = f"ipc://{tmp_path}/server.sock"
    s3_flags = [
        "--s3-bucket",
        "tc-secrets",
        "--s3-endpoint-url",
        proxy.url,
        "--s3-region",
        "us-east-1",
        "--s3-path-style",
    ]
    cli = [sys.executable, "-m", "tiercache.cli"]
    server = subprocess.Popen(
        [
            *cli,
            "server",
            "--tiers",
            "l1,s3",
            "--l1-size-gb",
            "0.01",
            "--listen",
            listen,
            "--log-level",
            "debug",
            *s3_flags,
            "--s3-create-bucket",
            "--s3-max-attempts",
            "1",
            "--s3-breaker-failures",
            "2",
            "--s3-read-timeout-s",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,  # a file: a pipe nobody reads fills up
    )
    outputs: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                client = Client(listen, timeout=1.0)
                client.timeout = 20.0
                break
            except ServerUnavailableError:
                assert server.poll() is None and time.monotonic() < deadline, "server did not start"
        with client:
            [group] = client.register([(0, manifest())])
            fp = Fingerprint(group.fingerprint)
            keys = [ObjectKey(fp, 0, i.to_bytes(16, "big")) for i in range(8)]
            client.store_chunks(keys[:4], [payload(k, 4096) for k in keys[:4]])
            wait_until(
                lambda: client.stats()["engine"]["l2_writes"] == 4,
                timeout=20,
                what="writes to S3 (the first lower tier)",
            )
            proxy.mode = "error"  # S3 failures get logged: with no credentials in them
            client.store_chunks(keys[4:], [payload(k, 4096) for k in keys[4:]])
            wait_until(
                lambda: client.stats()["engine"]["write_failures"] >= 1, timeout=20, what="a failed write"
            )
            client.lookup([i.to_bytes(16, "big") for i in range(100, 104)], [group], prefetch=False)
            proxy.mode = "ok"
            for args in (
                ["inspect", "summary", "--server", listen],
                ["inspect", "summary", "--json", "--server", listen],
                ["inspect", "keys", "--server", listen],
                ["inspect", "summary", *s3_flags],
                ["inspect", "fingerprints", *s3_flags],
                ["inspect", "summary", "--s3-bucket", "no-such-bucket", "--s3-endpoint-url", proxy.url],
                [
                    "server",
                    "--tiers",
                    "l1,s3",
                    "--s3-bucket",
                    "tc-secrets",
                    "--s3-endpoint-url",
                    "http://127.0.0.1:1",
                    "--listen",
                    f"ipc://{tmp_path}/other.sock",
                ],
            ):
                run = subprocess.run([*cli, *args], capture_output=True, text=True, env=env, timeout=60)
                outputs.append(run.stdout + run.stderr)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
        log.close()
        proxy.close()
    out = (tmp_path / "server.log").read_text()
    outputs.append(out)
    everything = "\n".join(outputs)
    lines = everything.count("\n")
    figures(
        "no-credentials",
        lines_checked=lines,
        commands=len(outputs),
        access_key_lines=sum(ACCESS_KEY in line for line in everything.splitlines()),
        secret_lines=sum(SECRET_KEY in line for line in everything.splitlines()),
    )
    assert "DEBUG" in out  # the server really logged at debug level
    assert SECRET_KEY not in everything
    assert ACCESS_KEY not in everything
