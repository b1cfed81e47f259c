"""S3 admission on the serving workload: two replicas on one bucket, with and without ``--l3-admission read``.

A *server-level replay* of ``benchmarks/serve.py``'s workloads, not a vLLM run: the prompts are built
from serve.py's own generator and sizes (its ``parse_args`` defaults, ``chat_openings``), and each
request is sent to a real tiercache server (its own process, real ZMQ sockets, L1 + LMDB disk + the
bucket on a moto server this script starts on 127.0.0.1) the way the vLLM connector drives it:

* vLLM's own prefix cache is modelled per replica as an LRU of chunks (serve.py's ``--blocks`` ×
  ``--block-size`` tokens); a request whose full chunks it already holds asks tiercache nothing;
* otherwise a lookup (with prefetch, as the connector's) of the prompt's chunks but the last token's,
  the found chunks read out of the arena (the workers' load), and a store of the prompt's full chunks
  from the first one not found (what the connector saves after the prefill);
* replica A takes the first ``--split`` of the requests, replica B the rest (B starts once A's writes
  have settled): B's external hit tokens are what it reuses of A's work through S3, plus its own.

Why not vLLM: two engines and their tiercache servers, twice (with and without the rule), do not fit
the two shared cores of this machine; what the rule changes (which chunks are PUT, which B then finds)
depends only on the sequence of lookups and stores, which the replay keeps. What it does not keep:
the generated tokens (seeded random tokens of ``--output-len`` stand in for the model's answers in
chat histories), vLLM's block-level cache (approximated by whole chunks) and request concurrency
(requests run one at a time per replica).

Prints one table per workload and write policy: PUTs per request, bytes written to S3, replica B's
external hit tokens (and those from S3), and the ratios ``read`` / ``all`` with the target verdict
(at least half the PUTs for at most 5% fewer hit tokens on B). Run from the repo root::

    python benchmarks/admission.py                      # serve.py's defaults, write-through
    python benchmarks/admission.py --policies through,back
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import shutil
import sys
import tempfile
import time
import types
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import progress  # noqa: E402  (after the path: from the checkout)
from tests.server.conftest import manifest  # noqa: E402  (after the path: tests/ from the checkout)
from tests.server.serverproc import ServerProcess, ServerSpec  # noqa: E402
from tiercache.client.client import Client  # noqa: E402
from tiercache.config import L3Admission, L3WritePolicy  # noqa: E402
from tiercache.keys import ExtraKeys, Fingerprint, ObjectKey, PrefixHasher  # noqa: E402
from tiercache.testing.fixtures import payload_for  # noqa: E402
from tiercache.testing.s3 import s3_endpoint  # noqa: E402
from tiercache.wire.protocol import GroupRef, TicketStateName  # noqa: E402

#: The target of issue 22: ``read`` needs at most this share of ``all``'s PUTs ...
PUT_TARGET = 0.5
#: ... for at least this share of ``all``'s hit tokens on replica B.
HIT_TARGET = 0.95
PREFIX = "admission"
BUCKET = "tiercache-admission"


log = progress("admission")


def import_serve() -> types.ModuleType:
    """``benchmarks/serve.py``, read-only, for its workload generator and sizes.

    serve.py imports httpx (its chat client) at module level; the replay sends no HTTP, so where the
    environment lacks httpx (the dev venv) an empty stand-in module satisfies that import only.
    """
    try:
        import httpx  # noqa: F401
    except ImportError:
        sys.modules["httpx"] = types.ModuleType("httpx")
    return importlib.import_module("benchmarks.serve")


# -- the workload ----------------------------------------------------------------------------------


def prefix_prompts(sargs: argparse.Namespace) -> list[list[int]]:
    """Shared documents, as vLLM's ``prefix_repetition`` dataset builds them for serve.py: ``--docs``
    random documents of ``--doc-len`` tokens, each followed by ``--questions`` random questions of
    ``--question-len`` tokens, all shuffled (seeded; the tiny tokenizer adds nothing to a prompt)."""
    import random

    rng = random.Random(sargs.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, sargs.vocab) for _ in range(n)]

    prompts = []
    for _ in range(sargs.docs):
        doc = tokens(sargs.doc_len)
        prompts += [doc + tokens(sargs.question_len) for _ in range(sargs.questions)]
    rng.shuffle(prompts)
    return prompts


def chat_prompts(serve: types.ModuleType, sargs: argparse.Namespace) -> list[list[int]]:
    """Multi-turn chat in serve.py's order (turn t of every user, then turn t + 1): its users' own
    messages (``chat_openings``), rendered as the tiny tokenizer's chat template does (``<s>`` then
    each message's words), with seeded random tokens standing in for the model's answers."""
    import random

    firsts, follow = serve.chat_openings(sargs)
    rng = random.Random(sargs.seed + 2)

    def ids(text: str) -> list[int]:
        return [int(word[1:]) for word in text.split()]  # the words are t<id>

    histories = [[1, *ids(f)] for f in firsts]  # 1: <s>
    prompts = []
    for turn in range(sargs.turns):
        for user in range(sargs.users):
            prompts.append(list(histories[user]))
            histories[user] += [rng.randrange(3, sargs.vocab) for _ in range(sargs.output_len)]
            if turn + 1 < sargs.turns:
                histories[user] += ids(follow[user][turn])
    return prompts


# -- one replica: vLLM's side of the connector -----------------------------------------------------


class LocalPrefixCache:
    """vLLM's own prefix cache, modelled as an LRU of whole chunks (by chunk hash)."""

    def __init__(self, chunks: int) -> None:
        self._capacity = chunks
        self._held: OrderedDict[bytes, None] = OrderedDict()

    def hit(self, hashes: list[bytes]) -> int:
        """Leading chunks of ``hashes`` held."""
        n = 0
        while n < len(hashes) and hashes[n] in self._held:
            n += 1
        return n

    def add(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self._held.pop(h, None)
            self._held[h] = None
        while len(self._held) > self._capacity:
            self._held.popitem(last=False)


@dataclass
class ReplicaCounts:
    requests: int = 0
    lookups: int = 0
    external_hit_tokens: int = 0  # loaded from tiercache beyond vLLM's own hit, as vLLM counts them
    stored_chunks: int = 0


@dataclass
class Replica:
    """One replica: a tiercache server and the connector logic in front of it."""

    name: str
    server: ServerProcess
    chunk: int
    chunk_bytes: int
    local: LocalPrefixCache
    client: Client = field(init=False)
    group: GroupRef = field(init=False)
    counts: ReplicaCounts = field(default_factory=ReplicaCounts)

    def connect(self) -> None:
        self.client = self.server.client(timeout=60.0)
        [self.group] = self.client.register([(0, manifest(chunk_size=self.chunk))])

    def key(self, h: bytes) -> ObjectKey:
        return ObjectKey(Fingerprint(self.group.fingerprint), self.group.object_group, h)

    def request(self, prompt: list[int]) -> None:
        """One request, as the connector runs it (see the module docstring)."""
        chunk = self.chunk
        hashes = list(PrefixHasher(chunk, ExtraKeys()).update(prompt))  # the prompt's full chunks
        limit = (len(prompt) - 1) // chunk  # vLLM always computes at least the last token
        local = self.local.hit(hashes)
        self.counts.requests += 1
        if local >= limit:  # vLLM has every chunk tiercache could offer: no lookup
            saved_from = local
        else:
            self.counts.lookups += 1
            found = self.client.lookup(hashes[:limit], [self.group], max_chunks=limit)
            if found.state is TicketStateName.PENDING:
                found = self.client.wait_ticket(found.ticket, timeout=60.0)
            if found.state is TicketStateName.READY:
                self.client.read_ticket(found)  # the workers' copy out of the arena
            elif found.ticket:
                self.client.release_ticket(found.ticket)
            # READY: the boundary every object of which was pinned (a failed promotion shortens it).
            hit = found.ready_chunks if found.state is TicketStateName.READY else 0
            self.counts.external_hit_tokens += max(0, hit - local) * chunk
            saved_from = hit
        new = hashes[saved_from:]
        if new:
            keys = [self.key(h) for h in new]
            stored = self.client.store_chunks(keys, [payload_for(k, self.chunk_bytes) for k in keys])
            self.counts.stored_chunks += stored
        self.local.add(hashes)

    def settle(self, quiet_s: float = 1.0, deadline_s: float = 120.0) -> dict[str, Any]:
        """Wait until the server's writes are done (queues empty, counters still for ``quiet_s``)."""
        end = time.monotonic() + deadline_s
        last: dict[str, Any] | None = None
        since = time.monotonic()
        while time.monotonic() < end:
            stats = self.client.stats()
            e = stats["engine"]
            snap = {k: v for k, v in e.items() if not k.endswith("_depth")}
            busy = e["l2_queue_depth"] or e["l3_queue_depth"]
            if busy or snap != last:
                last, since = snap, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return stats
            time.sleep(0.1)
        raise TimeoutError(f"replica {self.name}'s writes did not settle in {deadline_s:g} s")

    def close(self) -> None:
        self.client.close()


# -- one run: a pair of replicas, one rule ---------------------------------------------------------


@dataclass
class RunResult:
    workload: str
    policy: str
    rule: str
    requests: int
    puts: int
    bytes_written: int
    bucket_objects: int  # listed from the bucket with boto3, as a check on ``puts``
    bucket_bytes: int
    b_hit_tokens: int
    b_s3_hit_objects: int  # chunk objects B's server read from S3
    admitted: int
    refused_unread: int
    refused_untracked: int
    waiting: int
    writeback_lost: int


def list_bucket(url: str, bucket: str) -> tuple[int, int]:
    """Chunk objects and their bytes under the shared prefix, listed with boto3 (manifests left out)."""
    import boto3
    from botocore.config import Config

    from tiercache.l3_s3.names import ObjectNames

    s3 = boto3.client(
        "s3", endpoint_url=url, region_name="us-east-1", config=Config(s3={"addressing_style": "path"})
    )
    names = ObjectNames(PREFIX)
    n = size = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=names.root):
        for obj in page.get("Contents", []):
            if names.key_of(obj["Key"]) is not None:
                n += 1
                size += int(obj["Size"])
    return n, size


def run_pair(
    *,
    workload: str,
    prompts: list[list[int]],
    policy: L3WritePolicy,
    rule: L3Admission,
    s3_url: str,
    root: Path,
    chunk: int,
    chunk_bytes: int,
    l1_bytes: int,
    disk_bytes: int,
    local_chunks: int,
    split: float,
) -> RunResult:
    """Replica A replays the first ``split`` of ``prompts``, then replica B the rest, on one bucket."""
    bucket = f"{BUCKET}-{uuid.uuid4().hex[:8]}"
    replicas: list[Replica] = []
    try:
        for name in ("a", "b"):
            spec = ServerSpec(
                listen=f"ipc://{root}/{name}.sock",
                l1_bytes=l1_bytes,
                disk_path=str(root / f"disk-{name}"),
                disk_budget=disk_bytes,
                s3_url=s3_url,
                s3_bucket=bucket,
                options={"chunk_size": chunk},
                s3_options={"prefix": PREFIX},
                engine_options={"l3_write_policy": policy, "l3_admission": rule},
            )
            replicas.append(
                Replica(name.upper(), ServerProcess(spec), chunk, chunk_bytes, LocalPrefixCache(local_chunks))
            )
        for r in replicas:
            r.server.wait_ready()
            r.connect()
        a, b = replicas
        cut = round(len(prompts) * split)
        for p in prompts[:cut]:
            a.request(p)
        stats_a = a.settle()
        for p in prompts[cut:]:
            b.request(p)
        stats_b = b.settle()
        stats_a = a.settle()  # nothing should have changed on A; asked again for the final counts
        objects, size = list_bucket(s3_url, bucket)
        both = (stats_a, stats_b)
        e = [s["engine"] for s in both]
        return RunResult(
            workload=workload,
            policy=policy.value,
            rule=rule.value,
            requests=len(prompts),
            puts=sum(int(s["tiers"]["s3"]["puts"]) for s in both),
            bytes_written=sum(int(s["tiers"]["s3"]["bytes_written"]) for s in both),
            bucket_objects=objects,
            bucket_bytes=size,
            b_hit_tokens=b.counts.external_hit_tokens,
            b_s3_hit_objects=int(stats_b["tiers"]["s3"]["hits"]),
            admitted=sum(int(x["l3_admitted"]) for x in e),
            refused_unread=sum(int(x["l3_refused_unread"]) for x in e),
            refused_untracked=sum(int(x["l3_refused_untracked"]) for x in e),
            waiting=sum(int(x["l3_admission_waiting"]) for x in e),
            writeback_lost=sum(
                int(x[f"writeback_lost_{r}"]) for x in e for r in ("queue_full", "write_failed", "shutdown")
            ),
        )
    finally:
        for r in replicas:
            with contextlib.suppress(Exception):
                r.close()
            r.server.stop()


# -- output ----------------------------------------------------------------------------------------


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def table(rows: list[RunResult]) -> str:
    """One block per (workload, policy): a row per rule, then the ratios and the verdict."""
    out = []
    head = (
        f"{'rule':<5} {'requests':>8} {'PUTs':>5} {'PUTs/req':>8} {'written':>11} {'bucket':>16} "
        f"{'B hit tokens':>12} {'B S3 objs':>9} {'admitted':>8} {'refused u/t':>11} {'waiting':>7} {'lost':>4}"
    )
    for key in dict.fromkeys((r.workload, r.policy) for r in rows):
        group = {r.rule: r for r in rows if (r.workload, r.policy) == key}
        out += [f"## workload {key[0]}, write policy {key[1]}", head]
        for r in group.values():
            out.append(
                f"{r.rule:<5} {r.requests:>8} {r.puts:>5} {r.puts / r.requests:>8.2f} "
                f"{mib(r.bytes_written):>11} {f'{r.bucket_objects} / {mib(r.bucket_bytes)}':>16} "
                f"{r.b_hit_tokens:>12} {r.b_s3_hit_objects:>9} {r.admitted:>8} "
                f"{f'{r.refused_unread}/{r.refused_untracked}':>11} {r.waiting:>7} {r.writeback_lost:>4}"
            )
        if "all" in group and "read" in group:
            base, rule = group["all"], group["read"]
            puts = rule.puts / base.puts if base.puts else float("nan")
            written = rule.bytes_written / base.bytes_written if base.bytes_written else float("nan")
            hits = rule.b_hit_tokens / base.b_hit_tokens if base.b_hit_tokens else float("nan")
            met = puts <= PUT_TARGET and hits >= HIT_TARGET
            # Under ``all`` every PUT that B never read from S3 is one a perfect rule could save.
            unread_by_b = max(0, base.puts - base.b_s3_hit_objects)
            out.append(
                f"read/all: PUTs {puts:.2f}x, bytes written {written:.2f}x, B hit tokens {hits:.2f}x "
                f"-> target (PUTs <= {PUT_TARGET:.2f}x, B hits >= {HIT_TARGET:.2f}x) "
                f"{'MET' if met else 'MISSED'}"
            )
            out.append(
                f"bound: under all, {unread_by_b} of {base.puts} PUTs were never read from S3 by B, so no "
                f"rule can save more than {unread_by_b / base.puts if base.puts else 0:.0%} of the PUTs "
                "here without costing B hits"
            )
        out.append("")
    return "\n".join(out)


def reset_moto(url: str) -> None:
    """Drop every bucket moto holds (its memory): each pair of runs leaves ~100 chunks of 2 MiB."""
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST")).close()


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Other options are serve.py's workload and model options (--docs, --users, --chunk-size, "
        "--blocks, ...), passed to its parser; see benchmarks/serve.py --help.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument(
        "--workloads", default="prefix,chat", help="comma list of serve.py's workloads: prefix, chat"
    )
    ap.add_argument(
        "--policies",
        default="through",
        help="comma list of write policies: through (the default one), back (the disk then holds a third "
        "of the working set, so that it evicts to S3)",
    )
    ap.add_argument(
        "--split", type=float, default=0.5, help="share of the requests replica A serves (first), B the rest"
    )
    ap.add_argument(
        "--chunk-bytes",
        type=int,
        default=None,
        help="bytes per chunk object (default: serve.py's model, K and V of every layer in float32)",
    )
    return ap.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, rest = parse_args(argv)
    serve = import_serve()
    sargs = serve.parse_args(rest)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "admission-bench")  # moto takes any credentials
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "admission-bench")
    chunk = sargs.chunk_size
    chunk_bytes = args.chunk_bytes or serve.kv_bytes_per_token(sargs) * chunk
    local_chunks = sargs.blocks * sargs.block_size // chunk
    workloads = [w for w in args.workloads.split(",") if w]
    policies = [L3WritePolicy(p) for p in args.policies.split(",") if p]
    rows: list[RunResult] = []
    root = Path(tempfile.mkdtemp(prefix="tiercache-admission-"))
    try:
        with s3_endpoint("moto") as url:
            for workload in workloads:
                prompts = prefix_prompts(sargs) if workload == "prefix" else chat_prompts(serve, sargs)
                one = argparse.Namespace(**{**vars(sargs), "workloads": [workload]})
                ws_bytes = serve.working_set_tokens(one) * chunk_bytes // chunk
                for policy in policies:
                    # L1 holds the working set (serve.py's 'full' budget); the disk twice that, or
                    # with write-back a third of it, so that it evicts (and writes back) to S3.
                    through = policy is L3WritePolicy.THROUGH
                    l1_bytes = int(ws_bytes * 1.25)
                    disk_bytes = max(int(ws_bytes * (2 if through else 1 / 3)), 4 * chunk_bytes)
                    for rule in (L3Admission.ALL, L3Admission.READ):
                        log(f"{workload}, {policy.value}, {rule.value}: {len(prompts)} requests")
                        t0 = time.monotonic()
                        run_dir = root / f"{workload}-{policy.value}-{rule.value}"
                        run_dir.mkdir()
                        rows.append(
                            run_pair(
                                workload=workload,
                                prompts=prompts,
                                policy=policy,
                                rule=rule,
                                s3_url=url,
                                root=run_dir,
                                chunk=chunk,
                                chunk_bytes=chunk_bytes,
                                l1_bytes=l1_bytes,
                                disk_bytes=disk_bytes,
                                local_chunks=local_chunks,
                                split=args.split,
                            )
                        )
                        reset_moto(url)
                        log(f"  done in {time.monotonic() - t0:.1f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"# server-level replay of benchmarks/serve.py's workloads (not vLLM): chunk {chunk} tokens, "
        f"{chunk_bytes} bytes per chunk object, vLLM's own cache modelled as {local_chunks} chunks, "
        f"replica A the first {args.split:.0%} of the requests, B the rest; S3 on moto"
    )
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
