"""Scenario: N client processes × M mixed operations against one server, every read checked.

Workers share a pool of prompts with a common system prefix (overlapping chunk hashes), and mix
store (reserve → copy → commit), lookup with prefetch + read through the arena, and pin-and-load.
Payloads are derived from the keys, so every byte read is checked. The data fits the budgets, so every
committed chunk must still be there at the end. Figures: operations, throughput, server peak RSS.
"""

from __future__ import annotations

import multiprocessing
import random
import time
from typing import Any

from tests.reliability.common import figures, payload, peak_rss_mib
from tests.server.conftest import StartServer, manifest
from tiercache.keys import ObjectKey, chunk_hashes
from tiercache.keys.fingerprint import Fingerprint
from tiercache.wire.protocol import TicketStateName

KiB = 1 << 10
MiB = 1 << 20
CHUNK_BYTES = 8 * KiB
PROMPTS = 24
SYSTEM = [7] * 512  # two chunks every prompt shares


def prompt_hashes(p: int) -> list[bytes]:
    return chunk_hashes(SYSTEM + [(p * 7919 + i) % 32000 for i in range(4 * 256)], 256)


def worker(endpoint: str, seed: int, ops: int, out: Any) -> None:
    """One client process: ``ops`` random operations; puts its counts and committed keys on ``out``."""
    from tiercache.client.client import Client

    rng = random.Random(seed)
    counts = dict(ops=0, stores=0, lookups=0, loads=0, chunks_read=0, wrong=0, errors=0)
    committed: set[bytes] = set()
    with Client(endpoint, timeout=30.0) as client:
        [group] = client.register([(0, manifest())])
        fp = Fingerprint(group.fingerprint)
        for _ in range(ops):
            p = rng.randrange(PROMPTS)
            hashes = prompt_hashes(p)
            keys = [ObjectKey(fp, 0, h) for h in hashes]
            op = rng.random()
            try:
                if op < 0.4:
                    n = rng.randrange(1, len(keys) + 1)
                    stored = client.store_chunks(keys[:n], [payload(k, CHUNK_BYTES) for k in keys[:n]])
                    assert stored == n
                    committed.update(k.to_bytes() for k in keys[:n])
                    counts["stores"] += 1
                elif op < 0.8:
                    found = client.lookup(hashes, [group])
                    if found.pending:
                        found = client.wait_ticket(found.ticket)
                    if found.state is TicketStateName.READY:
                        for k, v in client.read_ticket(found).items():
                            counts["chunks_read"] += 1
                            counts["wrong"] += v != payload(k, CHUNK_BYTES)
                    counts["lookups"] += 1
                else:
                    for k, v in zip(keys, client.load_chunks(keys)):
                        if v is not None:
                            counts["chunks_read"] += 1
                            counts["wrong"] += v != payload(k, CHUNK_BYTES)
                    counts["loads"] += 1
            except Exception:  # counted and reported: the test asserts there are none
                counts["errors"] += 1
            counts["ops"] += 1
    out.put((counts, committed))


def test_many_client_processes_mixed_ops_every_read_checked(start_server: StartServer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    n_procs, m_ops = 4, 250
    server = start_server(l1_bytes=32 * MiB, disk_path=str(tmp_path / "disk"), disk_budget=256 * MiB)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(server.endpoint, s, m_ops, out), daemon=True) for s in range(n_procs)
    ]
    start = time.monotonic()
    for proc in procs:
        proc.start()
    results = [out.get(timeout=240) for _ in procs]
    wall = time.monotonic() - start
    for proc in procs:
        proc.join(30)
    total: dict[str, int] = {}
    committed: set[bytes] = set()
    for counts, keys in results:
        for k, v in counts.items():
            total[k] = total.get(k, 0) + v
        committed |= keys
    rss = peak_rss_mib(server.process.pid)
    with server.client() as client:
        lost = wrong_end = 0
        for raw in committed:
            k = ObjectKey.from_bytes(raw)
            got = client.get(k)
            lost += got is None
            wrong_end += got is not None and got != payload(k, CHUNK_BYTES)
        stats = client.stats()
    figures(
        "load",
        processes=n_procs,
        ops=total["ops"],
        stores=total["stores"],
        lookups=total["lookups"],
        loads=total["loads"],
        chunks_read_checked=total["chunks_read"],
        wrong_reads=total["wrong"] + wrong_end,
        errors=total["errors"],
        distinct_committed=len(committed),
        lost_commits=lost,
        ops_per_s=total["ops"] / wall,
        server_peak_rss_mib=rss,
        stores_dropped=stats["engine"]["stores_dropped"],
    )
    assert total["errors"] == 0
    assert total["wrong"] == 0 and wrong_end == 0
    assert lost == 0
    assert total["chunks_read"] > 0
    assert rss < 512  # bounded: a 32 MiB arena and small budgets, not growth with operations
