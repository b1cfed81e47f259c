"""Specification: `tiercache inspect summary` and the metrics say what S3 admission decided.

A server process with ``--l3-admission read`` (write-through, a window of 4 chunks, a bucket on moto
over HTTP) stores 6 chunks one at a time: the 2 oldest drop out of the window unread (refused). A
lookup then reads chunks 4 and 5 and a pin (``load_chunks``) chunk 3: those 3 go to S3 (admitted);
chunk 2 still waits for a first read. The summary line, its JSON and a scrape all say so.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cli.test_metrics import sample
from tests.conftest import S3Endpoint
from tests.server.conftest import manifest
from tests.server.serverproc import ServerProcess, ServerSpec
from tests.server.test_data_path import store_prompt
from tiercache.cli.app import main
from tiercache.config import L3Admission
from tiercache.keys import Fingerprint, ObjectKey, chunk_hashes
from tiercache.server.metrics import render
from tiercache.testing.poll import wait_until

CHUNKS = 6


@pytest.fixture
def decided(tmp_path: Path, s3: S3Endpoint) -> Iterator[tuple[ServerProcess, dict[str, Any]]]:
    """The server, and its stats once the reads' S3 writes are done."""
    proc = ServerProcess(
        ServerSpec(
            listen=f"ipc://{tmp_path}/server.sock",
            disk_path=str(tmp_path / "disk"),
            s3_url=s3.url,
            options={"chunk_size": 256},
            engine_options={"l3_admission": L3Admission.READ, "l3_admission_window": 4},
        )
    )
    try:
        proc.wait_ready()
        with proc.client() as client:
            [group] = client.register([(0, manifest())])
            hashes = chunk_hashes(list(range(CHUNKS * 256)), 256)
            for n, h in enumerate(hashes, start=1):
                store_prompt(client, group, [h])
                wait_until(lambda n=n: client.stats()["engine"]["l2_writes"] == n, what=f"chunk {n} on disk")

            found = client.lookup(hashes[4:], [group])  # a connector's load of chunks 4 and 5
            assert found.chunks == 2
            client.read_ticket(found)
            key3 = ObjectKey(Fingerprint(group.fingerprint), group.object_group, hashes[3])
            assert client.load_chunks([key3])[0] is not None  # a pin: a read too

            def written() -> dict[str, Any] | None:
                stats = client.stats()
                return stats if stats["engine"]["l3_writes"] == 3 else None

            stats = wait_until(written, what="the 3 admitted chunks in S3")
        yield proc, stats
    finally:
        proc.stop()


def test_the_summary_says_what_s3_admission_admitted_refused_and_still_waits_for(
    decided: tuple[ServerProcess, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    proc, stats = decided
    engine = stats["engine"]
    assert (engine["l3_admitted"], engine["l3_refused_unread"], engine["l3_refused_untracked"]) == (3, 2, 0)
    assert stats["tiers"]["s3"]["puts"] == 3

    assert main(["inspect", "summary", "--server", proc.endpoint]) == 0
    out = capsys.readouterr().out
    assert "S3 admission: admitted 3, refused 2 (unread 2, untracked 0), waiting 1" in out

    assert main(["inspect", "summary", "--server", proc.endpoint, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["engine"]
    assert (shown["l3_admitted"], shown["l3_refused_unread"], shown["l3_admission_waiting"]) == (3, 2, 1)

    text = render(stats)  # what a scrape of this server's metrics shows
    assert sample(text, "tiercache_engine_l3_admitted_total") == 3
    assert sample(text, "tiercache_engine_l3_refused_total", reason="unread") == 2
    assert sample(text, "tiercache_engine_l3_refused_total", reason="untracked") == 0
    assert sample(text, "tiercache_engine_l3_admission_waiting") == 1
