"""Benchmark the server protocol: lookup latency per tier and the arena data path (not run in CI).

* lookup p50/p99 of a 128k-token prompt (512 chunks of 256 tokens) when every chunk is in L1, in L2
  (LMDB, after a server restart) and in L3 (moto's S3 server on 127.0.0.1, after a restart);
* store and load throughput through the arena (this process → server process: reserve, copy, commit;
  pin, copy, release) against a raw shared-memory copy of the same bytes in the same run;
* what the shared secret costs on the hot path: the L1 lookup of 512 chunks and a store of 16 chunks
  (reserve, copy, commit) on a server with ``auth_secret`` (every message signed and checked both
  ways) against one without, both running, measured in alternation in the same run (ipc for both,
  so only the signing differs);
* the lookup as the vLLM connector sends it (``--only-connector``): the scheduler's 512-chunk L1
  lookup with ``prefetch``, ``max_chunks`` and ``inflight_wait_s`` as its defaults ask, answered with
  a READY ticket and one pinned slot per chunk, sent with ``lookup_async`` and collected with
  ``poll`` (its ticket released outside the timing), against the count-only lookup
  (``prefetch=False``) and a bare ZMQ round trip over ipc measured in the same run, alternating.

The server runs in its own process over an ipc socket, as in production. Usage::

    python benchmarks/protocol.py [--chunk-kb 2048] [--chunks 64] [--rounds 5] [--lookups 200]
                                  [--no-s3] [--only-auth] [--only-connector]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import pct
from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.client.client import Client
from tiercache.config.connector import ConnectorSettings
from tiercache.keys import (
    Fingerprint,
    GroupKind,
    LayoutManifest,
    ObjectKey,
    chunk_hashes,
)
from tiercache.l1.arena import SharedArena
from tiercache.wire.protocol import GroupRef

MiB = 1 << 20
CHUNK_TOKENS = 256
Row = tuple[str, str, str, str]
MANIFEST = LayoutManifest(
    model_id="bench",
    model_revision="r1",
    kv_dtype="bfloat16",
    attention_backend="TORCH_SDPA",
    kv_layout="NHD",
    kernel_block_size=16,
    manager_block_size=16,
    page_bytes=4096,
    page_bytes_unpadded=4096,
    group_kind=GroupKind.FULL_ATTENTION,
    chunk_size=CHUNK_TOKENS,
    num_layers=2,
)


def lookup_latency(client: Client, hashes: list[bytes], group: GroupRef, n: int) -> tuple[float, float, int]:
    client.lookup(hashes, [group], prefetch=False)  # warm: the S3 tier caches existence answers
    samples = []
    chunks = 0
    for _ in range(n):
        t0 = time.perf_counter()
        chunks = client.lookup(hashes, [group], prefetch=False).chunks
        samples.append(time.perf_counter() - t0)
    return pct(samples, 0.5) * 1e3, pct(samples, 0.99) * 1e3, chunks


def store_small(client: Client, group: GroupRef, hashes: list[bytes], nbytes: int) -> None:
    fp = Fingerprint(group.fingerprint)
    keys = [ObjectKey(fp, 0, h) for h in hashes]
    for i in range(0, len(keys), 64):
        client.store_chunks(keys[i : i + 64], [os.urandom(nbytes)] * len(keys[i : i + 64]))
        # Let the write-through queue drain between bursts: the server drops (and counts) writes
        # beyond its queue depth rather than block, and this benchmark wants every chunk stored.
        while client.stats()["engine"]["l2_queue_depth"]:  # type: ignore[index]
            time.sleep(0.01)


def auth_cost(start: Callable[..., ServerProcess], hashes: list[bytes], n: int) -> list[Row]:
    """Lookup and store p50 with and without the shared secret, alternating between the servers."""
    secret = "bench-secret-3f8a1c9e07d2b645"
    plain = start(l1_bytes=64 * MiB)
    signed = start(l1_bytes=64 * MiB, options={"auth_secret": secret})
    samples: dict[str, dict[bool, list[float]]] = {
        "lookup": {False: [], True: []},
        "store": {False: [], True: []},
    }
    with plain.client(timeout=60) as a, signed.client(timeout=60, auth_secret=secret) as b:
        clients = {False: a, True: b}
        groups = {k: c.register([(0, MANIFEST)])[0] for k, c in clients.items()}
        for k, c in clients.items():
            store_small(c, groups[k], hashes, 16 * 1024)
            c.lookup(hashes, [groups[k]], prefetch=False)
        payloads = [os.urandom(16 * 1024)] * 16
        for i in range(n):
            for k in (i % 2 == 0, i % 2 == 1):  # alternate which goes first
                c, group = clients[k], groups[k]
                t0 = time.perf_counter()
                c.lookup(hashes, [group], prefetch=False)
                samples["lookup"][k].append(time.perf_counter() - t0)
                keys = [
                    ObjectKey(Fingerprint(group.fingerprint), 0, h)
                    for h in chunk_hashes([i, *range(16 * 16)], 16)
                ]
                t0 = time.perf_counter()
                c.store_chunks(keys[:16], payloads)
                samples["store"][k].append(time.perf_counter() - t0)
    plain.stop()
    signed.stop()
    rows: list[Row] = []
    for name, label in (("lookup", "lookup 512 chunks, L1 hits"), ("store", "store 16 x 16 KiB via arena")):
        off, on = pct(samples[name][False], 0.5) * 1e3, pct(samples[name][True], 0.5) * 1e3
        rows.append(
            (f"{label}, shared secret", f"{on:.3f} ms", f"no secret {off:.3f} ms", f"ratio {on / off:.2f}x")
        )
    return rows


def zmq_round_trip(tmp: Path, n: int) -> list[float]:
    """Bare DEALER → ROUTER → DEALER round trips of a small frame over ipc, to a server in its own
    process (what any request pays before its handler runs), in seconds."""
    import multiprocessing

    import zmq

    path = f"ipc://{tmp}/echo.sock"
    ready = multiprocessing.get_context("spawn").Event()
    echo = multiprocessing.get_context("spawn").Process(target=_echo, args=(path, n + 10, ready), daemon=True)
    echo.start()
    ready.wait(30)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(path)
    samples = []
    for i in range(n + 10):
        t0 = time.perf_counter()
        sock.send(b"x" * 64)
        sock.recv()
        if i >= 10:
            samples.append(time.perf_counter() - t0)
    sock.close(0)
    ctx.term()
    echo.join(10)
    return samples


def _echo(path: str, n: int, ready: Any) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(path)
    ready.set()
    for _ in range(n):
        sock.send_multipart(sock.recv_multipart())
    sock.close(0)
    ctx.term()


def connector_lookup(
    start: Callable[..., ServerProcess], hashes: list[bytes], n: int, tmp: Path
) -> list[Row]:
    """The scheduler's lookup of a 128k-token prompt, every chunk in L1, as the connector sends it,
    against the count-only lookup in alternation (same server, same client)."""
    settings = ConnectorSettings()
    srv = start(l1_bytes=64 * MiB)
    samples: dict[str, list[float]] = {"connector": [], "count": []}
    slots = 0
    with srv.client(timeout=60) as c:
        [group] = c.register([(0, MANIFEST)])
        store_small(c, group, hashes, 16 * 1024)

        def as_connector() -> tuple[float, Any]:
            t0 = time.perf_counter()
            req = c.lookup_async(
                hashes,
                [group],
                prefetch=True,
                max_chunks=len(hashes),
                inflight_wait_s=settings.inflight_wait_s,
                tenant=b"",
            )
            while (result := c.poll(req, wait_s=1.0)) is None:
                pass
            return time.perf_counter() - t0, result

        for _ in range(10):  # warm both paths
            c.release_ticket(as_connector()[1].ticket)
            c.lookup(hashes, [group], prefetch=False)
        for i in range(n):
            for which in ("connector", "count") if i % 2 == 0 else ("count", "connector"):
                if which == "connector":
                    dt, result = as_connector()
                    assert result.state.value == "ready" and result.ready_chunks == len(hashes), result.state
                    slots = len(result.held)
                    c.release_ticket(result.ticket)  # the scheduler releases it in a later step
                else:
                    t0 = time.perf_counter()
                    c.lookup(hashes, [group], prefetch=False)
                    dt = time.perf_counter() - t0
                samples[which].append(dt)
    srv.stop()
    bare = zmq_round_trip(tmp, n)
    p50 = {k: pct(v, 0.5) * 1e3 for k, v in samples.items()}
    rt = pct(bare, 0.5) * 1e3
    bound = "MET" if p50["connector"] < 1.0 else "MISSED"
    return [
        (
            "512-chunk L1 lookup round trip p50 over ipc, as the connector sends it (prefetch, ticket, slots)",
            f"{p50['connector']:.3f} ms",
            f"p99 {pct(samples['connector'], 0.99) * 1e3:.3f} ms",
            f"{slots} slots; < 1 ms {bound}",
        ),
        (
            "512-chunk L1 lookup round trip p50 over ipc, count only (prefetch=False)",
            f"{p50['count']:.3f} ms",
            f"p99 {pct(samples['count'], 0.99) * 1e3:.3f} ms",
            f"connector {p50['connector'] / p50['count']:.2f}x",
        ),
        (
            "bare ZMQ DEALER/ROUTER round trip p50 over ipc (baseline)",
            f"{rt:.3f} ms",
            f"p99 {pct(bare, 0.99) * 1e3:.3f} ms",
            f"connector {p50['connector'] / rt:.1f}x",
        ),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk-kb", type=int, default=2048, help="chunk size for the throughput rows")
    ap.add_argument("--chunks", type=int, default=64, help="chunks per throughput round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lookups", type=int, default=200)
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--only-auth", action="store_true", help="only the shared secret's cost (about 30 s)")
    ap.add_argument(
        "--only-connector",
        action="store_true",
        help="only the lookup as the vLLM connector sends it (a few s)",
    )
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="tc-bench-"))
    hashes = chunk_hashes(list(range(512 * CHUNK_TOKENS)), CHUNK_TOKENS)
    rows: list[Row] = []
    procs: list[ServerProcess] = []

    def start(**kw: Any) -> ServerProcess:
        options = {"chunk_size": CHUNK_TOKENS, **kw.pop("options", {})}
        spec = ServerSpec(listen=f"ipc://{tmp}/s{len(procs)}/server.sock", options=options, **kw)
        proc = ServerProcess(spec)
        procs.append(proc)
        proc.wait_ready(auth_secret=options.get("auth_secret"))
        return proc

    moto = None
    try:
        if not args.only_auth:
            rows += connector_lookup(start, hashes, args.lookups, tmp)
        if args.only_connector:
            return report(rows)
        rows += auth_cost(start, hashes, args.lookups)
        if args.only_auth:
            return report(rows)
        # -- lookup latency: L1, then L2 after a restart ------------------------------------------
        disk = str(tmp / "lmdb")
        srv = start(disk_path=disk, l1_bytes=64 * MiB, disk_budget=256 * MiB)
        with srv.client(timeout=60) as c:
            [group] = c.register([(0, MANIFEST)])
            store_small(c, group, hashes, 16 * 1024)
            p50, p99, n = lookup_latency(c, hashes, group, args.lookups)
            rows.append(("lookup 512 chunks, L1 hits", f"{p50:.3f} ms", f"{p99:.3f} ms", f"{n} chunks"))
        srv.stop()
        srv = start(disk_path=disk, l1_bytes=64 * MiB, disk_budget=256 * MiB)
        with srv.client(timeout=60) as c:
            p50, p99, n = lookup_latency(c, hashes, group, args.lookups)
            rows.append(("lookup 512 chunks, L2 hits", f"{p50:.3f} ms", f"{p99:.3f} ms", f"{n} chunks"))
        srv.stop()
        if not args.no_s3:
            import logging

            from moto.server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.ERROR)
            for k, v in (
                ("AWS_ACCESS_KEY_ID", "x"),
                ("AWS_SECRET_ACCESS_KEY", "x"),
                ("AWS_DEFAULT_REGION", "us-east-1"),
            ):
                os.environ.setdefault(k, v)
            moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            moto.start()
            host, port = moto.get_host_and_port()
            url = f"http://{host}:{port}"
            srv = start(s3_url=url, l1_bytes=64 * MiB)
            with srv.client(timeout=120) as c:
                c.register([(0, MANIFEST)])
                store_small(c, group, hashes, 16 * 1024)
            srv.stop()
            srv = start(s3_url=url, l1_bytes=64 * MiB)
            with srv.client(timeout=120) as c:
                p50, p99, n = lookup_latency(c, hashes, group, args.lookups)
                rows.append(
                    (
                        "lookup 512 chunks, L3 hits (warm existence cache)",
                        f"{p50:.3f} ms",
                        f"{p99:.3f} ms",
                        f"{n} chunks",
                    )
                )
            srv.stop()

        # -- throughput: arena path vs raw shared-memory copy -------------------------------------
        nbytes = args.chunk_kb * 1024
        total = nbytes * args.chunks
        payloads = [os.urandom(nbytes) for _ in range(args.chunks)]
        srv = start(l1_bytes=total * 2 + 64 * MiB)
        with srv.client(timeout=60) as c:
            [group] = c.register([(0, MANIFEST)])
            fp = Fingerprint(group.fingerprint)
            keys = [ObjectKey(fp, 0, h) for h in hashes[: args.chunks]]
            c.store_chunks(keys[:1], payloads[:1])  # attach the arena outside the timing
            store_t, load_t = [], []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                c.store_chunks(keys, payloads)
                store_t.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                out = c.load_chunks(keys)
                load_t.append(time.perf_counter() - t0)
                assert out[0] == payloads[0]
        srv.stop()
        raw_store, raw_load = [], []
        with SharedArena.create(f"tc-bench-{uuid.uuid4().hex[:8]}", total) as arena:
            views = [arena.view(i * nbytes, nbytes) for i in range(args.chunks)]
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                for v, data in zip(views, payloads):
                    v[:] = data
                raw_store.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                out = [bytes(v) for v in views]
                raw_load.append(time.perf_counter() - t0)
            del views, out

        def gbs(ts: list[float]) -> float:
            return total / statistics.median(ts) / 1e9

        for name, ours, raw in (("store", store_t, raw_store), ("load", load_t, raw_load)):
            rows.append(
                (
                    f"{name} {args.chunks} x {args.chunk_kb} KiB via arena",
                    f"{gbs(ours):.2f} GB/s",
                    f"raw shm {gbs(raw):.2f} GB/s",
                    f"ratio {gbs(ours) / gbs(raw):.2f}x",
                )
            )
    finally:
        for proc in procs:
            proc.stop()
        if moto is not None:
            moto.stop()

    return report(rows)


def report(rows: list[Row]) -> int:
    print(f"# cpus={os.cpu_count()} python={sys.version.split()[0]}")
    width = max(52, *(len(r[0]) for r in rows))
    print(f"| {'case':<{width}} | {'p50 / ours':>12} | {'p99 / baseline':>20} | {'note':>14} |")
    print(f"|{'-' * (width + 2)}|{'-' * 14}|{'-' * 22}|{'-' * 16}|")
    for r in rows:
        print(f"| {r[0]:<{width}} | {r[1]:>12} | {r[2]:>20} | {r[3]:>14} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
