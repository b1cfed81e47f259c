"""Benchmark one server under many clients: what a node's engines cost it (not run in CI).

A node runs one server for all its engines (every GPU's worker and scheduler, SGLang beside vLLM).
This starts a server (L1 only, in its own process, over ipc, as in production) and client processes
that each repeat one operation on 64-chunk prompts whose chunks are all in L1, for 1, 2, 4, ... 32
clients at once, with 64 more clients connected and idle (heartbeating) throughout:

* ``lookup``: the scheduler's lookup as the vLLM connector sends it (a prefetch ticket pinning every
  chunk, answered READY with its slots), then the ticket's release, held back to ride the client's
  next lookup as the connector's scheduler does (``Lookup.releases``: no message of its own, no
  reply);
* ``load``: pin the 64 chunks, copy them out of the arena, check their digests, release;
* ``store``: reserve 64 new chunks, copy them in, commit them with their digests;
* ``ping`` (not run by default): one round trip that touches no tier, what any request costs the
  server;
* ``zmq`` (not run by default): the same round trip to a bare pyzmq ROUTER in a process of its own
  that reads and answers as the server's loop does (poll, then non-blocking receives and sends):
  the transport's floor under every request, the baseline for ``ping``;
* ``uds`` (not run by default): the same round trip over a bare Unix stream socket that one loop
  reads itself (epoll, then non-blocking receives and sends), without libzmq's I/O threads on
  either side: what a transport of that kind would cost.

For each operation and client count it prints operations per second (all clients together), the
p50 / p99 latency of one operation as its client saw it, the server's CPU time per operation and per
chunk (from the server process's own user + system time over the phase), the throughput against
one client's, measured in the same run, and the lowest and highest p99 of the clients taken one by
one (a tail every client shares comes from the server; one some clients have alone comes from their
turns on busy cores). Usage::

    python benchmarks/many_clients.py [--clients 1,2,4,8,16,32] [--idle 64] [--seconds 3]
                                      [--ops lookup,load,store] [--chunk-kb 16]
    python benchmarks/many_clients.py --ops ping,zmq,uds
    python benchmarks/many_clients.py --size [--size-l1-gb 16] [--size-disk-objects 1000000]

``--transport unix`` runs the server on a ``unix://`` endpoint (a Unix stream socket its loop reads
itself) instead of ``ipc://`` (ZMQ), and the clients with it. ``--server-nice -5`` runs the server
at nice -5 (root or CAP_SYS_NICE), ahead of its clients when the cores are busy: what
docs/server.md's advice on CPU priority gains.

``--against TREE`` compares this tree's server with another tiercache source tree's (``git worktree
add /tmp/base <commit>``): each round runs the table once from each tree (each tree's own script,
client and server, the same interpreter), the order alternating between rounds, and prints each
row's server CPU per operation from both, then per row the ratios (this ÷ that) of every round and
their median, of the server's CPU and of the p99: how the published "halved" figures are made
(``--transport`` and ``--server-nice`` apply to both trees where that tree's script takes them; an
older one's server listens on ``ipc://`` at the default priority). ::

    python benchmarks/many_clients.py --against /tmp/base --ops load --clients 1,16 --rounds 10

``--size`` runs lookups on a small server (L1 0.5 GiB, an empty disk tier) and then on a large one
(L1 16 GiB, a disk tier holding 1M objects written before it starts) and prints, for each, the
server's start time (spawn to its first answered hello: the arena mapped, the disk tier opened), its
resident memory after the lookups and the lookup p50, with the large ÷ small ratio of the same run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import os
import selectors
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import cpu_seconds, pct
from tests.server.conftest import manifest
from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.client.client import Client
from tiercache.config.connector import ConnectorSettings
from tiercache.keys import Fingerprint, ObjectKey, chunk_hashes
from tiercache.wire.protocol import GroupRef

MiB = 1 << 20
CHUNKS = 64
CHUNK_TOKENS = 256
#: What --ops may name; the last three touch no tier (the µs/chunk column is empty for them).
OPS = ("lookup", "load", "store", "ping", "zmq", "uds")
ROUND_TRIPS = ("ping", "zmq", "uds")
#: The ``uds`` op's request: a length, then the body; the echo sends it back.
UDS_PING = (4).to_bytes(4, "big") + b"ping"
#: Prompts stored before the runs; the clients look them up and load them round-robin.
PROMPTS = 16
L1_GB = 0.5  # the server's L1 by default
MANIFEST = manifest(model_id="bench-many-clients", chunk_size=CHUNK_TOKENS)


def prompt_keys(group: GroupRef, prompt: int) -> tuple[list[bytes], list[ObjectKey]]:
    """The chunk hashes of stored prompt ``prompt`` and their object keys."""
    hashes = chunk_hashes([prompt, *range(CHUNKS * CHUNK_TOKENS - 1)], CHUNK_TOKENS)
    return hashes, [ObjectKey(Fingerprint(group.fingerprint), group.object_group, h) for h in hashes]


def echo(endpoint: str) -> None:
    """The ``zmq`` op's server: a bare ROUTER answering each request with its body, read and
    answered as the server's loop does (poll, then non-blocking receives and sends)."""
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(endpoint)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while True:
        poller.poll(1000)
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            sock.send_multipart(sock.recv_multipart(zmq.NOBLOCK), zmq.NOBLOCK)


def unix_echo(path: str) -> None:
    """The ``uds`` op's server: a Unix stream socket whose one loop waits on every connection
    (epoll) and receives and answers without blocking, echoing what came; no I/O thread."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1024)
    listener.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    while True:
        for ready, _ in selector.select(1.0):
            conn = ready.fileobj
            assert isinstance(conn, socket.socket)
            if conn is listener:
                peer, _ = listener.accept()
                peer.setblocking(False)
                selector.register(peer, selectors.EVENT_READ)
                continue
            try:
                data = conn.recv(65536)
            except BlockingIOError:
                continue
            if not data:
                selector.unregister(conn)
                conn.close()
                continue
            conn.sendall(data)  # one small request outstanding per client: the buffer takes it


def unix_round_trip(sock: socket.socket) -> None:
    """Send :data:`UDS_PING` and read its echo whole."""
    sock.sendall(UDS_PING)
    got = 0
    while got < len(UDS_PING):
        got += len(sock.recv(64))


def worker(
    endpoint: str,
    floors: dict[str, str],
    index: int,
    chunk_bytes: int,
    conn: multiprocessing.connection.Connection,
) -> None:
    """A client process: on each ``(op, start, until)`` it repeats ``op`` from ``start`` until
    ``until`` (wall clock) and sends back its latencies in seconds; ``None`` ends it. ``floors``:
    the endpoints of the bare echoes (``zmq``, ``uds``) that run."""
    inflight_wait_s = ConnectorSettings().inflight_wait_s
    bare = unix = None
    if "zmq" in floors:
        bare = zmq.Context().socket(zmq.DEALER)
        bare.connect(floors["zmq"])
    if "uds" in floors:
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.connect(floors["uds"])
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
                    # As the connector does: the release rides this client's next lookup.
                    client.release_ticket_later(found.ticket, read=True)
                elif op == "ping":
                    client.ping()
                    samples.append(time.perf_counter() - t0)
                elif op == "zmq":
                    assert bare is not None
                    bare.send(b"ping")
                    bare.recv()
                    samples.append(time.perf_counter() - t0)
                elif op == "uds":
                    assert unix is not None
                    unix_round_trip(unix)
                    samples.append(time.perf_counter() - t0)
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
            client.flush_releases()
            conn.send(samples)


def memory_kib(pid: int) -> dict[str, int]:
    """``VmRSS``, ``RssAnon`` and ``RssShmem`` of ``pid`` in KiB (the arena's touched pages are its
    shared memory; its index and everything else the server keeps, anonymous memory)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {k: int(fields[k].split()[0]) for k in ("VmRSS", "RssAnon", "RssShmem")}


def fill_disk(path: Path, objects: int, object_bytes: int, budget: int) -> float:
    """Write ``objects`` objects of ``object_bytes`` into a disk tier at ``path`` (before its server
    starts: what a node's disk holds after a while), in seconds."""
    from tiercache.config import DiskConfig
    from tiercache.l2_disk import DiskTier

    fp = Fingerprint(b"\x07" * 16)
    payload = os.urandom(object_bytes)
    t0 = time.perf_counter()
    tier = DiskTier(DiskConfig(path=path, budget_bytes=budget))
    try:
        for i in range(objects):
            tier.put(ObjectKey(fp, 0, i.to_bytes(16, "big")), payload)
            if i and i % 100_000 == 0:
                print(f"  disk: {i:,} of {objects:,} objects written", file=sys.stderr, flush=True)
    finally:
        tier.close()
    return time.perf_counter() - t0


@dataclass(frozen=True)
class CaseResult:
    """One server's figures: seconds from spawn to its first answered hello, its memory after the
    runs (:func:`memory_kib`), and each ``(op, clients)`` row's ``p50_ms`` and ``p99_ms``."""

    start_s: float
    memory: dict[str, int]
    rows: dict[tuple[str, int], dict[str, float]]


def run_case(
    args: argparse.Namespace, spec: ServerSpec, ops: list[str], counts: list[int], title: str
) -> CaseResult:
    """Start a server from ``spec``, store the prompts, run each op at each client count; print
    ``title`` with the server's nice value as its process has it, then the table, and return the
    server's start seconds, its memory after the runs and each row's figures."""
    chunk_bytes = args.chunk_kb * 1024
    ctx = multiprocessing.get_context("spawn")
    t0 = time.perf_counter()
    server = ServerProcess(spec)
    server.wait_ready(deadline_s=600)
    start_s = time.perf_counter() - t0
    pid = server.process.pid
    assert pid is not None
    print(f"{title}, server at nice {os.getpriority(os.PRIO_PROCESS, pid)}\n\n{HEADER}", flush=True)
    floors: dict[str, str] = {}  # op -> its bare echo's endpoint
    echoes: dict[str, multiprocessing.process.BaseProcess] = {}
    for op, serve, endpoint in (
        ("zmq", echo, f"ipc://{spec.listen.split('://', 1)[1]}.echo"),
        ("uds", unix_echo, spec.listen.split("://", 1)[1] + ".uds"),
    ):
        if op in ops:
            floors[op] = endpoint
            echoes[op] = ctx.Process(target=serve, args=(endpoint,), daemon=True)
            echoes[op].start()
    if "uds" in floors:
        while not os.path.exists(floors["uds"]):  # connect() does not wait for the bind, as zmq's does
            time.sleep(0.01)
    idle = [Client(server.endpoint, timeout=30, client_name=f"idle-{i}") for i in range(args.idle)]
    with server.client(timeout=60) as setup:
        [group] = setup.register([(0, MANIFEST)])
        for i in range(PROMPTS):
            _, keys = prompt_keys(group, i)
            assert setup.store_chunks(keys, [os.urandom(chunk_bytes)] * CHUNKS) == CHUNKS
    workers = []
    for index in range(max(counts)):
        here, there = ctx.Pipe()
        proc = ctx.Process(
            target=worker, args=(server.endpoint, floors, index, chunk_bytes, there), daemon=True
        )
        proc.start()
        workers.append((proc, here))
    for _, conn in workers:
        assert conn.recv() == "ready"
    rows: dict[tuple[str, int], dict[str, float]] = {}
    try:
        for op in ops:
            single = 0.0
            for n in counts:
                start = time.time() + 0.3
                for _, conn in workers[:n]:
                    conn.send((op, start, start + args.seconds))
                time.sleep(max(0.0, start - time.time()))
                measured = echoes[op].pid if op in echoes else pid
                assert measured is not None
                cpu0 = cpu_seconds(measured)
                by_client = [conn.recv() for _, conn in workers[:n]]
                samples = [s for mine in by_client for s in mine]
                cpu = cpu_seconds(measured) - cpu0
                rate = len(samples) / args.seconds
                single = single or rate
                per_op = cpu / max(1, len(samples)) * 1e6
                row = rows[op, n] = {
                    "p50_ms": statistics.median(samples) * 1e3,
                    "p99_ms": pct(samples, 0.99) * 1e3,
                }
                per_chunk = "–" if op in ROUND_TRIPS else f"{per_op / CHUNKS:.1f}"
                # A tail every client shares is the server's; one some clients have alone is theirs
                # (their turn on a busy core).
                mine = sorted(pct(s, 0.99) * 1e3 for s in by_client if s)
                spread = f"{mine[0]:.2f}–{mine[-1]:.2f}" if len(mine) > 1 else f"{row['p99_ms']:.2f}"
                print(
                    f"| {op} | {n} | {rate:,.0f} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} | {per_op:.0f} | "
                    f"{per_chunk} | {rate / single:.2f} | {spread} |",
                    flush=True,
                )
        memory = memory_kib(pid)  # after the runs: the arena populated, the indexes built
    finally:
        for _, conn in workers:
            conn.send(None)
        for proc, _ in workers:
            proc.join(10)
        for client in idle:
            client.close()
        for floor in echoes.values():
            floor.kill()
            floor.join(10)
        server.stop()
    return CaseResult(start_s, memory, rows)


HEADER = (
    "| op | clients | ops/s | p50 ms | p99 ms | server CPU µs/op | µs/chunk | ops/s ÷ 1 client "
    "| p99 ms by client |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def size_case(args: argparse.Namespace, tmp: Path) -> int:
    """The small server (L1 ``--l1-gb``, an empty disk tier) against the large one (L1
    ``--size-l1-gb``, a disk tier holding ``--size-disk-objects`` objects), lookups at 1 and 16
    clients: start time, memory and lookup p50 side by side."""
    counts = [int(n) for n in args.clients.split(",")]
    print(
        f"{os.cpu_count()} cores, {args.idle} idle clients, lookups of {CHUNKS} chunks, {args.seconds:g} s per phase"
    )
    servers = (("small", args.l1_gb, 0), ("large", args.size_l1_gb, args.size_disk_objects))
    cases: dict[str, CaseResult] = {}
    for name, l1_gb, objects in servers:
        disk = tmp / f"disk-{name}"
        budget = max(64 * MiB, int(objects * (args.size_object_kb * 1024 + 512) * 1.3))
        if objects:
            took = fill_disk(disk, objects, args.size_object_kb * 1024, budget)
            print(
                f"\n{name}: disk tier filled with {objects:,} objects of {args.size_object_kb} KiB in {took:.0f} s"
            )
        spec = ServerSpec(
            listen=f"{args.transport}://{tmp}/{name}.sock",
            l1_bytes=int(l1_gb * 1024) * MiB,
            disk_path=str(disk),
            disk_budget=budget,
            nice=args.server_nice,
        )
        title = f"\n{name}: L1 {l1_gb:g} GiB, disk tier {objects:,} objects"
        cases[name] = run_case(args, spec, ["lookup"], counts, title)
    p50s = " | ".join(f"lookup p50 ms, {n} client{'s' if n > 1 else ''}" for n in counts)
    print(f"\n| server | L1 GiB | disk objects | start s | RSS MiB | of it anonymous | {p50s} |")
    print("|---" * (6 + len(counts)) + "|")
    for name, l1_gb, objects in servers:
        c = cases[name]
        p50 = " | ".join(f"{c.rows['lookup', n]['p50_ms']:.2f}" for n in counts)
        print(
            f"| {name} | {l1_gb:g} | {objects:,} | {c.start_s:.1f} | {c.memory['VmRSS'] / 1024:,.0f} | "
            f"{c.memory['RssAnon'] / 1024:,.0f} | {p50} |"
        )
    small_rows, large_rows = cases["small"].rows, cases["large"].rows
    ratios = ", ".join(
        f"{n} client(s) {large_rows['lookup', n]['p50_ms'] / small_rows['lookup', n]['p50_ms']:.2f}×"
        for n in counts
    )
    print(f"\nlookup p50, large ÷ small (same run): {ratios}")
    return 0


def table_rows(text: str) -> dict[tuple[str, int], tuple[float, float]]:
    """The server CPU µs per operation and the p99 ms of each ``(op, clients)`` row of a printed
    table."""
    rows: dict[tuple[str, int], tuple[float, float]] = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split("|")]
        if len(cells) > 7 and cells[1] in OPS:
            rows[cells[1], int(cells[2])] = (float(cells[6]), float(cells[5]))
    return rows


def against(args: argparse.Namespace) -> int:
    """``--against``: the table from this tree and from ``args.against``, alternately, and each
    row's ratios (this ÷ that) of server CPU and of p99, with their medians."""
    trees = {"this": Path(__file__).resolve().parents[1], "that": Path(args.against).resolve()}
    script = Path("benchmarks") / "many_clients.py"
    if not (trees["that"] / script).is_file():
        print(
            f"no {script} under {trees['that']}: give a tiercache source tree (git worktree add DIR COMMIT)",
            file=sys.stderr,
        )
        return 2
    same = ["--ops", ",".join(args.ops), "--clients", args.clients or "1,16", "--seconds", str(args.seconds)]
    same += ["--idle", str(args.idle), "--chunk-kb", str(args.chunk_kb)]
    if args.l1_gb != L1_GB:  # (an older tree's script may not take it)
        same += ["--l1-gb", str(args.l1_gb)]
    # Both trees on the same transport and priority, where that tree's script takes them (an older
    # one has ipc alone and its server at the default priority).
    theirs = (trees["that"] / script).read_text()
    only: dict[str, list[str]] = {"this": [], "that": []}
    for flag, value in (("--transport", args.transport), ("--server-nice", str(args.server_nice))):
        only["this"] += [flag, value]
        if f'"{flag}"' in theirs:
            only["that"] += [flag, value]
    runs: dict[str, list[dict[tuple[str, int], tuple[float, float]]]] = {"this": [], "that": []}
    print(f"this: {trees['this']} {' '.join(only['this'])}\nthat: {trees['that']} {' '.join(only['that'])}")
    print("server CPU µs per operation, per round:\n")
    for round_ in range(args.rounds):
        for side in ("this", "that") if round_ % 2 == 0 else ("that", "this"):
            tree = trees[side]
            done = subprocess.run(
                [sys.executable, str(tree / script), *same, *only[side]],
                cwd=tree,
                env={**os.environ, "PYTHONPATH": str(tree)},  # that tree's tiercache, not this one's
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                print(f"{side}'s run failed ({tree}):\n{done.stderr[-2000:]}", file=sys.stderr)
                return 1
            rows = table_rows(done.stdout)
            runs[side].append(rows)
            cells = ", ".join(f"{op} {n}: {us:,.0f}" for (op, n), (us, _) in rows.items())
            print(f"round {round_ + 1}, {side}: {cells}", flush=True)
    for at, what, unit in ((0, "server CPU", "µs/op"), (1, "p99", "p99 ms")):
        print(
            f"\n| op | clients | {what}, this ÷ that, each round (sorted) | median | this {unit} | that {unit} |"
        )
        print("|---|---|---|---|---|---|")
        for key in runs["this"][0]:
            mine = [rows[key][at] for rows in runs["this"]]
            other = [rows[key][at] if key in rows else float("nan") for rows in runs["that"]]
            ratios = sorted(a / b for a, b in zip(mine, other))
            print(
                f"| {key[0]} | {key[1]} | {', '.join(f'{r:.2f}' for r in ratios)} | {statistics.median(ratios):.2f} | "
                f"{min(mine):,.{2 * at}f}–{max(mine):,.{2 * at}f} | {min(other):,.{2 * at}f}–{max(other):,.{2 * at}f} |"
            )
    return 0


def can_raise_priority(increment: int) -> bool:
    """Whether a child of this process may add ``increment`` (< 0) to its nice value: asked of a
    throwaway child, as the server's process would."""
    return (
        subprocess.run(
            [sys.executable, "-c", f"import os; os.nice({increment})"], capture_output=True
        ).returncode
        == 0
    )


def op_list(text: str) -> list[str]:
    """``--ops``: names from :data:`OPS`, comma-separated; run in that order whatever the order
    given (stores fill L1 and evict the prompts that lookups and loads expect to find)."""
    ops = [op.strip() for op in text.split(",") if op.strip()]
    unknown = sorted(set(ops) - set(OPS))
    if unknown or not ops:
        raise argparse.ArgumentTypeError(
            f"unknown operation(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(OPS)}"
        )
    return [op for op in OPS if op in ops]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--clients",
        default=None,
        help="client counts to run, comma-separated (default 1,2,4,8,16,32; 1,16 with --size)",
    )
    ap.add_argument("--idle", type=int, default=64, help="idle connected clients throughout")
    ap.add_argument("--seconds", type=float, default=3.0, help="length of each phase")
    ap.add_argument(
        "--ops",
        type=op_list,
        default="lookup,load,store",
        help=f"operations to run, comma-separated, of {', '.join(OPS)} (ping, zmq, uds: a round trip to "
        "the server, to a bare pyzmq ROUTER: the transport's floor, and over a bare Unix socket)",
    )
    ap.add_argument(
        "--chunk-kb", type=int, default=16, help="bytes of a chunk (loads copy, stores write them)"
    )
    ap.add_argument(
        "--l1-gb", type=float, default=L1_GB, help="the server's L1 (the small server's with --size)"
    )
    ap.add_argument(
        "--size",
        action="store_true",
        help="compare a small server with a large one (--size-l1-gb of L1, a disk tier of "
        "--size-disk-objects objects): start time, memory and lookup latency",
    )
    ap.add_argument("--size-l1-gb", type=float, default=16.0, help="--size: the large server's L1")
    ap.add_argument(
        "--size-disk-objects", type=int, default=1_000_000, help="--size: objects on the large server's disk"
    )
    ap.add_argument("--size-object-kb", type=int, default=4, help="--size: bytes of each of those objects")
    ap.add_argument(
        "--against",
        metavar="TREE",
        help="compare with another tiercache source tree's server (e.g. git worktree add /tmp/base "
        "COMMIT): the table from each, alternately, and each row's ratios (this ÷ that) and median",
    )
    ap.add_argument("--rounds", type=int, default=5, help="--against: rounds (each runs both trees)")
    ap.add_argument(
        "--transport",
        choices=("ipc", "unix"),
        default="ipc",
        help="the server's endpoint: ipc:// (ZMQ) or unix:// (a Unix socket its loop reads itself); "
        "with --against, this tree's only",
    )
    ap.add_argument(
        "--server-nice",
        type=int,
        default=0,
        help="added to the server process's nice value (negative: it runs ahead of its clients on busy "
        "cores; needs root or CAP_SYS_NICE)",
    )
    args = ap.parse_args()
    if args.server_nice < 0 and not can_raise_priority(args.server_nice):
        ap.error(
            f"--server-nice {args.server_nice} needs root or CAP_SYS_NICE (this process may not raise its priority)"
        )
    if args.against:
        if args.size:
            ap.error("--against compares the table, not --size")
        return against(args)
    tmp = Path(tempfile.mkdtemp(prefix="tiercache-many-"))
    try:
        return run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # with --size, gigabytes of disk tier


def run(args: argparse.Namespace, tmp: Path) -> int:
    """The table (or, with ``--size``, the size case) with sockets and disk tiers under ``tmp``."""
    if args.size:
        args.clients = args.clients or "1,16"
        return size_case(args, tmp)
    counts = [int(n) for n in (args.clients or "1,2,4,8,16,32").split(",")]
    title = (
        f"{os.cpu_count()} cores, {args.idle} idle clients, {CHUNKS} chunks of {args.chunk_kb} KiB per "
        f"operation, {args.seconds:g} s per phase"
    )
    spec = ServerSpec(
        listen=f"{args.transport}://{tmp}/server.sock",
        l1_bytes=int(args.l1_gb * 1024) * MiB,
        nice=args.server_nice,
    )
    run_case(args, spec, args.ops, counts, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
