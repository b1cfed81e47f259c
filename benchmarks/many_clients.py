"""Benchmark one server under many clients: what a node's engines cost it (not run in CI).

A node runs one server for all its engines (every GPU's worker and scheduler, SGLang beside vLLM).
This starts a server (L1 only, in its own process, over ipc, as in production) and client processes
that each repeat one operation on 64-chunk prompts whose chunks are all in L1, for 1, 2, 4, ... 32
clients at once, with 64 more clients connected and idle (heartbeating) throughout:

* ``lookup``: the scheduler's lookup as the vLLM connector sends it (a prefetch ticket pinning every
  chunk, answered READY with its slots), then the ticket's release, not waited for (as the connector's
  scheduler sends it: the server sends no reply to it);
* ``load``: pin the 64 chunks, copy them out of the arena, check their digests, release;
* ``store``: reserve 64 new chunks, copy them in, commit them with their digests.

For each operation and client count it prints operations per second (all clients together), the
p50 / p99 latency of one operation as its client saw it, the server's CPU time per operation and per
chunk (from the server process's own user + system time over the phase), and the throughput against
one client's, measured in the same run. Usage::

    python benchmarks/many_clients.py [--clients 1,2,4,8,16,32] [--idle 64] [--seconds 3]
                                      [--ops lookup,load,store] [--chunk-kb 16]
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.server.conftest import manifest
from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.client.client import Client
from tiercache.config.connector import ConnectorSettings
from tiercache.keys import Fingerprint, ObjectKey, chunk_hashes
from tiercache.wire.protocol import GroupRef

MiB = 1 << 20
CHUNKS = 64
CHUNK_TOKENS = 256
#: Prompts stored before the runs; the clients look them up and load them round-robin.
PROMPTS = 16
MANIFEST = manifest(model_id="bench-many-clients", chunk_size=CHUNK_TOKENS)


def prompt_keys(group: GroupRef, prompt: int) -> tuple[list[bytes], list[ObjectKey]]:
    """The chunk hashes of stored prompt ``prompt`` and their object keys."""
    hashes = chunk_hashes([prompt, *range(CHUNKS * CHUNK_TOKENS - 1)], CHUNK_TOKENS)
    return hashes, [ObjectKey(Fingerprint(group.fingerprint), group.object_group, h) for h in hashes]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker(endpoint: str, index: int, chunk_bytes: int, conn: multiprocessing.connection.Connection) -> None:
    """A client process: on each ``(op, start, until)`` it repeats ``op`` from ``start`` until
    ``until`` (wall clock) and sends back its latencies in seconds; ``None`` ends it."""
    inflight_wait_s = ConnectorSettings().inflight_wait_s
    with Client(endpoint, timeout=30, client_name=f"bench-{index}") as client:
        [group] = client.register([(0, MANIFEST)])
        prompts = [prompt_keys(group, i) for i in range(PROMPTS)]
        payload = os.urandom(chunk_bytes)
        conn.send("ready")
        stored = 0
        while (command := conn.recv()) is not None:
            op, start, until = command
            samples: list[float] = []
            i = index
            time.sleep(max(0.0, start - time.time()))
            while time.time() < until:
                hashes, keys = prompts[i % PROMPTS]
                i += 1
                t0 = time.perf_counter()
                if op == "lookup":
                    found = client.lookup(hashes, [group], inflight_wait_s=inflight_wait_s)
                    samples.append(time.perf_counter() - t0)
                    assert found.ready_chunks == CHUNKS, found.state
                    client.release_ticket_unconfirmed(found.ticket, read=True)  # as the connector does
                elif op == "load":
                    copies = client.load_chunks(keys)
                    samples.append(time.perf_counter() - t0)
                    assert all(c is not None for c in copies)
                else:
                    stored += 1
                    fresh = [
                        ObjectKey(Fingerprint(group.fingerprint), group.object_group, h)
                        for h in chunk_hashes(
                            [1000 + index, stored, *range(CHUNKS * CHUNK_TOKENS - 2)], CHUNK_TOKENS
                        )
                    ]
                    assert client.store_chunks(fresh, [payload] * CHUNKS) == CHUNKS
                    samples.append(time.perf_counter() - t0)
            conn.send(samples)


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,2,4,8,16,32", help="client counts to run, comma-separated")
    ap.add_argument("--idle", type=int, default=64, help="idle connected clients throughout")
    ap.add_argument("--seconds", type=float, default=3.0, help="length of each phase")
    ap.add_argument("--ops", default="lookup,load,store", help="operations to run, comma-separated")
    ap.add_argument(
        "--chunk-kb", type=int, default=16, help="bytes of a chunk (loads copy, stores write them)"
    )
    args = ap.parse_args()
    counts = [int(n) for n in args.clients.split(",")]
    ops = args.ops.split(",")
    chunk_bytes = args.chunk_kb * 1024
    ctx = multiprocessing.get_context("spawn")
    tmp = Path(tempfile.mkdtemp(prefix="tiercache-many-"))
    server = ServerProcess(ServerSpec(listen=f"ipc://{tmp}/server.sock", l1_bytes=512 * MiB))
    server.wait_ready()
    pid = server.process.pid
    assert pid is not None
    idle = [Client(server.endpoint, timeout=30, client_name=f"idle-{i}") for i in range(args.idle)]
    with server.client(timeout=60) as setup:
        [group] = setup.register([(0, MANIFEST)])
        for i in range(PROMPTS):
            _, keys = prompt_keys(group, i)
            assert setup.store_chunks(keys, [os.urandom(chunk_bytes)] * CHUNKS) == CHUNKS
    workers = []
    for index in range(max(counts)):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(server.endpoint, index, chunk_bytes, there), daemon=True)
        proc.start()
        workers.append((proc, here))
    for _, conn in workers:
        assert conn.recv() == "ready"
    print(
        f"server pid {pid}, {os.cpu_count()} cores, {args.idle} idle clients, {CHUNKS} chunks of "
        f"{args.chunk_kb} KiB per operation, {args.seconds:g} s per phase\n"
    )
    print("| op | clients | ops/s | p50 ms | p99 ms | server CPU µs/op | µs/chunk | ops/s ÷ 1 client |")
    print("|---|---|---|---|---|---|---|---|")
    try:
        for op in ops:
            single = 0.0
            for n in counts:
                start = time.time() + 0.3
                for _, conn in workers[:n]:
                    conn.send((op, start, start + args.seconds))
                time.sleep(max(0.0, start - time.time()))
                cpu0 = cpu_seconds(pid)
                samples = [s for _, conn in workers[:n] for s in conn.recv()]
                cpu = cpu_seconds(pid) - cpu0
                rate = len(samples) / args.seconds
                single = single or rate
                per_op = cpu / max(1, len(samples)) * 1e6
                print(
                    f"| {op} | {n} | {rate:,.0f} | {statistics.median(samples) * 1e3:.2f} | "
                    f"{pct(samples, 0.99) * 1e3:.2f} | {per_op:.0f} | {per_op / CHUNKS:.1f} | {rate / single:.2f} |",
                    flush=True,
                )
    finally:
        for _, conn in workers:
            conn.send(None)
        for proc, _ in workers:
            proc.join(10)
        for client in idle:
            client.close()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
