"""Serving benchmark: vLLM's own load generator against vLLM's OpenAI server, one KV cache after another.

Every system serves the same tiny seeded Llama (float32, so prefill costs real time on a CPU), the
same prompts and the same seed, with vLLM's own KV cache capped below the working set
(``--num-gpu-blocks-override``), so what an external cache serves shows in throughput and TTFT:

* ``none``: no connector, vLLM's own prefix cache only (the baseline every row is compared with);
* ``tiercache``: ``tiercache server --tiers l1,disk`` and the ``TierCacheConnector``;
* ``lmcache``: LMCache's multiprocess server, memory only; ``lmcache-fs``: the same with its ``fs``
  L2 adapter;
* ``example``: vLLM's ``ExampleConnector`` (safetensors files; unbounded, so it has no budget).

Fair to every system (``benchmarks/serve_plan.py``): every server, vLLM's and the cache servers',
starts from one interpreter (``--python``; checked before anything starts, with the command that
installs tiercache and LMCache side by side if a system cannot import there), every engine computes
on the same CPUs (``--engine-cpus``) and, with ``--pin all`` (the default), every vLLM server runs
there and every cache server and the load generator on the CPUs left (``--pin engine``: only the
engines' compute threads are bound), the systems' order is rotated across ``--runs``, and every
system settles the same way between its phases.

Workloads: ``prefix`` (shared documents: ``vllm.benchmarks.serve`` with ``--dataset-name
prefix_repetition``, several questions per document, shuffled), ``chat`` (multi-turn chat: users
whose history grows each turn, round-robin across users so a user's history has left vLLM's capped
cache by its next turn; a small streaming client on httpx, since the wheel has no such dataset) and
``miss`` (unique prompts, ``--dataset-name random``: what a cache costs when nothing is reused; cold
phases only, and best run alone with ``--blocks`` large enough that nothing is preempted, e.g.
``--workloads miss --systems none,tiercache --budgets full --no-floor --blocks 512``).

Budgets: ``full`` (the cache server's L1 holds the working set) and ``third`` (a third of it: tiercache
serves the rest from its disk tier, LMCache from ``fs`` when it has it, else recomputes).

Phases: ``cold`` (first engine, empty cache server) and ``restart`` (a fresh vLLM server on the same,
still running, cache server). ``none`` runs once: without an external cache a restart is a cold start.

The floor (``--floor``, on unless ``--quick``): an engine whose own KV cache holds the whole working set
runs the prompts twice (the second pass is vLLM's own prefix cache, what any external cache chases),
then an engine of the same size restarts on the ``full`` tiercache server. Those rows compare like
for like; the capped rows do not compare with them (a capped engine also runs fewer requests at once).

``--capacity`` is the restart's tail under a short cache: long documents, more in flight than vLLM's
capped cache holds, a third of the working set in L1, so a restart promotes most of what it loads from
disk; every cached row prints its cache server's CPU per request and per promoted chunk.

Table and targets on stdout, progress on stderr, everything with ``--json FILE``, the figure with
``--png FILE`` (needs matplotlib: the ``bench`` extra). Run from the repo root::

    .venv-serve/bin/python benchmarks/serve.py --runs 3 --json serve.json --png serve.png
    .venv-vllm/bin/python benchmarks/serve.py --quick          # none and tiercache, a few requests
    .venv-serve/bin/python benchmarks/serve.py --capacity --runs 3   # tiercache and lmcache-fs
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402  (the vLLM venv has it; after the path so tests/ imports from the checkout)

from benchmarks.common import (  # noqa: E402
    add_pin_arguments,
    cpu_seconds,
    cpu_set,
    engine_env,
    lmcache_server_argv,
    pinned,
    placement,
    progress,
    stop_process,
    tiercache_server_argv,
    tiercache_stats,
    wait_for_port,
    wait_for_tiercache,
)
from benchmarks.serve_figure import write_figure  # noqa: E402
from benchmarks.serve_plan import (  # noqa: E402  (the fairness rules, tested without vLLM)
    Install,
    Probe,
    Settled,
    Unit,
    install_error,
    install_problems,
    plan,
    probe_install,
    rotated,
    settle,
    tree_size,
)
from benchmarks.serve_report import (  # noqa: E402  (pure: the table and targets, tested without vLLM)
    LMCACHE_SYSTEMS,
    PREEMPTIONS,
    PROMPT_COMPUTED,
    WORKLOADS,
    Phase,
    WorkloadResult,
    format_targets,
    rows_of,
    table,
    targets,
)
from tests.e2e.openai_server import (  # noqa: E402
    EXTERNAL_HITS,
    EXTERNAL_QUERIES,
    OpenAIServer,
    api_server_argv,
    free_port,
)

MiB = 1 << 20
GiB = 1 << 30
SYSTEMS = ("none", "tiercache", "tiercache-chunks", "lmcache", "lmcache-fs", "example")
#: ``tiercache`` runs the connector's defaults (tails on: blocks past the last full chunk stored and
#: matched); ``tiercache-chunks`` turns tails off (whole chunks only), to show what they cost and win.
TIERCACHE_SYSTEMS = ("tiercache", "tiercache-chunks")
BUDGETS = ("full", "third")
LOCAL_HITS = "vllm:prefix_cache_hits_total"
LOCAL_QUERIES = "vllm:prefix_cache_queries_total"
#: The settle rule between a system's phases, the same for every system (serve_plan.settle): at
#: least SETTLE_MIN_S, and until each of its probes has been quiet for SETTLE_QUIET_S (a cache
#: server using under IDLE_CPU_SHARE of a core is idle), at most SETTLE_DEADLINE_S.
SETTLE_MIN_S = 2.0
SETTLE_QUIET_S = 1.0
SETTLE_DEADLINE_S = 60.0
IDLE_CPU_SHARE = 0.05
#: Added to every vLLM server's and cache server's environment, whatever the system: LMCache reports
#: usage unless told not to, and the same environment for all keeps the systems' servers alike.
SERVER_ENV = {"LMCACHE_TRACK_USAGE": "false"}


log = progress("serve")


# -- sizes -----------------------------------------------------------------------------------------


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    """K and V of every layer for one token, float32."""
    return 2 * args.layers * args.kv_heads * args.head_dim * 4


def working_set_tokens(args: argparse.Namespace) -> int:
    """Distinct prompt tokens of the chosen workloads (documents once, each question's suffix and
    output; each user's whole history): what a cache must hold so that nothing is computed twice."""
    total = 0
    if "prefix" in args.workloads:
        total += args.docs * args.doc_len + args.docs * args.questions * (args.question_len + args.output_len)
    if "chat" in args.workloads:
        per_user = 1 + args.first_len + args.turns * args.output_len + (args.turns - 1) * args.turn_len
        total += args.users * per_user
    if "miss" in args.workloads:
        total += args.miss_prompts * (args.miss_len + args.output_len)
    return total


def budget_gb(args: argparse.Namespace, budget: str) -> float:
    """L1 size of the cache servers: the working set with 25% headroom (``full``) or a third of it."""
    ws = working_set_tokens(args) * kv_bytes_per_token(args)
    size = ws * 1.25 if budget == "full" else ws / 3
    return round(size / GiB, 4)


def floor_blocks(args: argparse.Namespace) -> int:
    """vLLM blocks for an engine whose own cache holds the whole working set (with room to spare)."""
    return int(working_set_tokens(args) * 1.3 / args.block_size) + 64


# -- cache servers ---------------------------------------------------------------------------------


@dataclass
class TierCacheServer:
    """``tiercache server --tiers l1,disk`` in a subprocess, socket and disk under ``root``."""

    python: str
    root: Path
    chunk: int
    l1_gb: float
    proc: subprocess.Popen[bytes] | None = None
    tails: bool = True  # the connector's ``tails`` setting (its default: on)
    cpus: str | None = None  # taskset's CPU list (placement())
    #: More ``kv_connector_extra_config`` settings (``--connector-config``).
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.root}/server.sock"

    def start(self) -> None:
        """Start it on an empty disk directory and wait for a hello round trip."""
        self.root.mkdir(parents=True, exist_ok=True)
        cmd = tiercache_server_argv(self.python, self.endpoint, self.chunk, self.l1_gb, self.root / "disk")
        log = self.root / "server.log"
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                pinned(cmd, self.cpus),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env=dict(os.environ, **SERVER_ENV),
            )
        wait_for_tiercache(self.proc, self.endpoint, log)

    def stats(self) -> dict[str, Any]:
        """The server's counters (``engine``: stores, hits, promotions, evictions, ...)."""
        return tiercache_stats(self.endpoint)

    def probes(self) -> list[Probe]:
        """Its store counter (a vLLM server's last stores may still be in flight when its last
        response returns, and a restart must find them) and the server's CPU time."""
        assert self.proc is not None
        pid = self.proc.pid
        return [
            Probe("tiercache stores", lambda: float(self.stats()["engine"].get("stores", 0))),
            Probe("tiercache server CPU", lambda: cpu_seconds(pid), IDLE_CPU_SHARE),
        ]

    def meter(self) -> dict[str, float]:
        """Its process tree's CPU seconds and the chunks it promoted from disk into L1, so far: a
        workload's cost on the node is the difference across it."""
        assert self.proc is not None
        promotions = float(self.stats()["engine"].get("promotions", 0))
        return {"cpu_s": cpu_seconds(self.proc.pid), "promotions": promotions}

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None

    def kv_transfer_config(self) -> dict[str, Any]:
        return {
            "kv_connector": "TierCacheConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "server": self.endpoint,
                **({} if self.tails else {"tails": False}),
                **self.settings,
            },
        }


def stored_line(stats: dict[str, Any]) -> str:
    """What a tiercache server stored and holds (objects and bytes per tier): the cost of tails is
    the ratio of two systems' lines over the same workload."""
    engine = stats.get("engine", {})
    tiers = stats.get("tiers") or engine.get("tiers", {})
    held = ", ".join(
        f"{name} {t.get('objects', 0)} objects {t.get('bytes_used', 0) / 2**20:.1f} MiB"
        for name, t in tiers.items()
    )
    return f"stores {engine.get('stores', 0)}, tails superseded {engine.get('tails_superseded', 0)}; holds {held}"


@dataclass
class LMCacheServer:
    """``lmcache server`` (multiprocess mode, shared memory), optionally with the ``fs`` L2 adapter."""

    python: str
    root: Path
    chunk: int
    l1_gb: float
    fs: bool
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    cpus: str | None = None  # taskset's CPU list (placement())

    def start(self) -> None:
        """Start it and wait until its port accepts connections."""
        self.root.mkdir(parents=True, exist_ok=True)
        fs = self.root / "fs" if self.fs else None
        if fs is not None:
            fs.mkdir(exist_ok=True)
        shm = f"lmc_serve_{os.getpid()}_{self.port}"
        cmd = lmcache_server_argv(self.python, self.chunk, self.l1_gb, self.port, shm, fs)
        log = self.root / "server.log"
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                pinned(cmd, self.cpus),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, **SERVER_ENV),
                cwd=self.root,
            )
        wait_for_port(self.proc, self.port, log)

    def probes(self) -> list[Probe]:
        """The server's CPU time (its own store counters are not reachable from here) and, with the
        ``fs`` adapter, the files it has written."""
        assert self.proc is not None
        pid = self.proc.pid
        out = [Probe("lmcache server CPU", lambda: cpu_seconds(pid), IDLE_CPU_SHARE)]
        if self.fs:
            out.append(Probe("lmcache fs files and bytes", lambda: tree_size(self.root / "fs")))
        return out

    def stats(self) -> None:
        """No counters of its own to record (see :meth:`probes`)."""
        return None

    def meter(self) -> dict[str, float]:
        """Its process tree's CPU seconds so far (it counts no promotions we can read)."""
        assert self.proc is not None
        return {"cpu_s": cpu_seconds(self.proc.pid)}

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None

    def kv_transfer_config(self) -> dict[str, Any]:
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": self.port},
        }


@dataclass
class ExampleStore:
    """vLLM's ExampleConnector: no server, safetensors files under ``root / "store"`` written by the
    vLLM worker itself."""

    root: Path
    l1_gb: float = 0.0  # unbounded: no budget

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def probes(self) -> list[Probe]:
        """The files it has written (and their bytes)."""
        return [Probe("example files and bytes", lambda: tree_size(self.root / "store"))]

    def stats(self) -> None:
        return None

    def meter(self) -> dict[str, float]:
        """Nothing: the vLLM worker itself writes the files, there is no server to meter."""
        return {}

    def stop(self) -> None:
        pass

    def kv_transfer_config(self) -> dict[str, Any]:
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(self.root / "store")},
        }


CacheServer = TierCacheServer | LMCacheServer | ExampleStore


def settle_cache(cache: CacheServer) -> Settled:
    """The one settle rule (serve_plan.settle) on this system's own probes."""
    return settle(
        cache.probes(), min_wait_s=SETTLE_MIN_S, quiet_s=SETTLE_QUIET_S, deadline_s=SETTLE_DEADLINE_S
    )


# -- workloads -------------------------------------------------------------------------------------


def run_vllm_bench(
    args: argparse.Namespace,
    server: OpenAIServer,
    model: Path,
    workload: str,
    dataset: list[str],
    prompts: int,
) -> WorkloadResult:
    """``prompts`` requests of ``dataset`` (``vllm.benchmarks.serve``'s dataset flags) through vLLM's
    own load generator, in this process (its report goes to stderr)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    bench_args = parser.parse_args(
        [
            "--backend=vllm",
            f"--base-url={server.url}",
            "--endpoint=/v1/completions",
            f"--model={server.model}",
            f"--tokenizer={model}",
            *dataset,
            f"--num-prompts={prompts}",
            f"--max-concurrency={args.concurrency}",
            "--request-rate=inf",
            "--ignore-eos",
            "--temperature=0",
            f"--seed={args.seed}",
            "--save-detailed",  # keeps per-request ttfts and generated_texts in the returned dict
            "--ready-check-timeout-sec=0",  # no test request: it would warm the caches with prompt 0
            "--disable-tqdm",
            "--percentile-metrics=ttft,e2el",
            "--metric-percentiles=50,90,99",
        ]
    )
    with contextlib.redirect_stdout(sys.stderr):
        res = main(bench_args)
    return WorkloadResult(
        workload,
        float(res["duration"]),
        int(res["completed"]),
        int(res["failed"]),
        int(res["total_input_tokens"]) + int(res["total_output_tokens"]),
        [float(t) for t in res["ttfts"]],
        [str(t) for t in res["generated_texts"]],
    )


def run_prefix(args: argparse.Namespace, server: OpenAIServer, model: Path) -> WorkloadResult:
    """Shared documents: several questions per document, shuffled."""
    dataset = [
        "--dataset-name=prefix_repetition",
        f"--prefix-repetition-prefix-len={args.doc_len}",
        f"--prefix-repetition-suffix-len={args.question_len}",
        f"--prefix-repetition-num-prefixes={args.docs}",
        f"--prefix-repetition-output-len={args.output_len}",
    ]
    return run_vllm_bench(args, server, model, "prefix", dataset, args.docs * args.questions)


def run_miss(args: argparse.Namespace, server: OpenAIServer, model: Path) -> WorkloadResult:
    """Unique prompts (the random dataset: random tokens, no shared prefix), so an external cache can
    only cost: its lookups find nothing and it stores every chunk."""
    dataset = [
        "--dataset-name=random",
        f"--random-input-len={args.miss_len}",
        f"--random-output-len={args.output_len}",
        "--random-range-ratio=0",
    ]
    return run_vllm_bench(args, server, model, "miss", dataset, args.miss_prompts)


def chat_turn(
    http: httpx.Client, model: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[float, str, int]:
    """One streamed, greedy chat completion: (TTFT s, text, prompt + completion tokens)."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    tokens = 0
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"chat answered {r.status_code}: {r.read().decode(errors='replace')}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if event.get("usage"):
                tokens = int(event["usage"]["total_tokens"])
            for choice in event.get("choices", []):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:  # the first chunk with text, as vllm.benchmarks.serve measures
                        ttft = time.perf_counter() - t0
                    parts.append(piece)
    return (ttft if ttft is not None else time.perf_counter() - t0), "".join(parts), tokens


def chat_openings(args: argparse.Namespace) -> tuple[list[str], list[list[str]]]:
    """Each user's first message and follow-ups: seeded random words of the tiny tokenizer."""
    import random

    from tiercache.testing.checkpoints import token_text

    rng = random.Random(args.seed + 1)

    def words(n: int) -> str:
        return token_text([rng.randrange(3, args.vocab) for _ in range(n)])

    firsts = [words(args.first_len) for _ in range(args.users)]
    follow = [[words(args.turn_len) for _ in range(args.turns - 1)] for _ in range(args.users)]
    return firsts, follow


def warmup_prompt(args: argparse.Namespace) -> str:
    """One document-and-question-sized prompt of its own seed: it shares no chunk with the workloads."""
    import random

    from tiercache.testing.checkpoints import token_text

    rng = random.Random(args.seed + 1_000_003)
    return token_text([rng.randrange(3, args.vocab) for _ in range(args.doc_len + args.question_len)])


def run_chat(args: argparse.Namespace, server: OpenAIServer) -> WorkloadResult:
    """Multi-turn chat: turn t of every user (``--concurrency`` at a time), then turn t + 1, each
    user's messages carrying its whole history; TTFT of each request from the stream."""
    firsts, follow = chat_openings(args)
    histories: list[list[dict[str, str]]] = [[{"role": "user", "content": f}] for f in firsts]
    ttfts: list[float] = []
    texts: list[str] = []
    tokens = 0
    failed = 0
    lock = threading.Lock()
    with httpx.Client(base_url=server.url, timeout=600.0) as http:

        def one(user: int) -> tuple[int, float | None, str, int]:
            try:
                ttft, text, n = chat_turn(http, server.model, histories[user], args.output_len)
            except (httpx.HTTPError, RuntimeError) as exc:
                # A failed request fails its row and the targets that read it (serve_report), as
                # vllm.benchmarks.serve counts its own failures; the other requests still run.
                log(f"chat request of user {user} failed: {exc}")
                return user, None, "", 0
            return user, ttft, text, n

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            for turn in range(args.turns):
                for user, ttft, text, n in pool.map(one, range(args.users)):
                    with lock:
                        if ttft is None or n == 0:
                            failed += 1  # no TTFT of a request that did not answer
                        else:
                            ttfts.append(ttft)
                        texts.append(text)
                        tokens += n
                    histories[user].append({"role": "assistant", "content": text})
                    if turn + 1 < args.turns:
                        histories[user].append({"role": "user", "content": follow[user][turn]})
        duration = time.perf_counter() - t0
    return WorkloadResult("chat", duration, len(ttfts), failed, tokens, ttfts, texts)


# -- one vLLM server, one phase --------------------------------------------------------------------


def vllm_argv(
    args: argparse.Namespace, model: Path, python: str, blocks: int, ktc: dict[str, Any] | None
) -> list[str]:
    """The OpenAI server's command: the same engine flags for every system."""
    flags = [
        "--dtype=float32",
        f"--block-size={args.block_size}",
        "--enable-prefix-caching",
        "--enforce-eager",
        "--seed=0",
        f"--max-model-len={args.max_model_len}",
        "--gpu-memory-utilization=0.1",  # on CPU: the share of host memory reserved at start
        f"--num-gpu-blocks-override={blocks}",
        # Whole prompts in one step: ExampleConnector saves only a chunked prefill's first step.
        f"--max-num-batched-tokens={max(4096, args.max_model_len)}",
        "--enable-prompt-tokens-details",
    ]
    if ktc is not None:
        flags.append(f"--kv-transfer-config={json.dumps(ktc)}")
    return api_server_argv(model, *flags, python=python)


def computed_prompt_tokens(server: OpenAIServer) -> float:
    """``vllm:prompt_tokens_by_source_total{source="local_compute"}`` summed over engines: prompt
    tokens vLLM prefilled itself (``OpenAIServer.metrics`` sums over every label, sources included)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=30.0).text
    return sum(
        float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:prompt_tokens_by_source_total"
        and sample.labels.get("source") == "local_compute"
    )


def counters(server: OpenAIServer) -> dict[str, float]:
    """vLLM's prefix cache and external (connector) cache counters (prompt tokens), the prompt tokens
    it computed, and tiercache's connector counters."""
    m = server.metrics()
    out = {k: m.get(k, 0.0) for k in (LOCAL_QUERIES, LOCAL_HITS, EXTERNAL_QUERIES, EXTERNAL_HITS)}
    out[PROMPT_COMPUTED] = computed_prompt_tokens(server)
    out[PREEMPTIONS] = m.get(PREEMPTIONS, 0.0)
    # The connector's own counters and load/store time histograms (docs/vllm.md, "Metrics"): where a
    # tiercache phase's time goes. Buckets summed over their bounds mean nothing, so they are left out.
    out.update(
        {
            k: v
            for k, v in m.items()
            if k.startswith("vllm:tiercache_") and not k.endswith(("_bucket", "_created"))
        }
    )
    return out


def serve_once(
    args: argparse.Namespace,
    work: Path,
    name: str,
    blocks: int,
    ktc: dict[str, Any] | None,
    passes: int = 1,
    *,
    cold: bool = True,
    meter: Callable[[], dict[str, float]] | None = None,
) -> tuple[float, list[dict[str, WorkloadResult]]]:
    """Start one vLLM server from ``--python`` (every system's), run every workload ``passes`` times,
    stop it; (start seconds, results). The environment is the same for every system too. ``miss``
    runs only on a ``cold`` engine's first pass: anywhere else its prompts were seen before.
    ``meter`` (a cache server's): read before and after each workload, the differences go to its
    result's ``cache`` (the work a cache server does after the last response is not in them)."""
    model = work / "model"
    t0 = time.perf_counter()
    server = OpenAIServer(
        pinned(vllm_argv(args, model, args.python, blocks, ktc), args.engine_pin),
        work / "logs" / f"{name}.log",
        env=SERVER_ENV | engine_env(args.engine_cpus),
    )
    try:
        server.wait_ready(timeout=args.start_timeout_s)
        start_s = time.perf_counter() - t0
        log(f"{name}: vLLM server ready in {start_s:.1f} s")
        if args.warmup:
            # A fresh engine's first forward passes pay one-time costs (allocations, kernel set-up);
            # without this, every restart row would carry them and the floor's second pass would not.
            t1 = time.perf_counter()
            server.complete(warmup_prompt(args), args.output_len)
            log(f"{name}: warm-up request {time.perf_counter() - t1:.1f} s")
        out: list[dict[str, WorkloadResult]] = []
        for p in range(passes):
            res: dict[str, WorkloadResult] = {}
            for wl in args.workloads:
                if wl == "miss" and (p > 0 or not cold):
                    continue
                before, metered = counters(server), meter() if meter else {}
                r = (
                    run_prefix(args, server, model)
                    if wl == "prefix"
                    else run_miss(args, server, model)
                    if wl == "miss"
                    else run_chat(args, server)
                )
                after = counters(server)
                r.counters = {k: after[k] - before.get(k, 0.0) for k in after}
                r.external_hits = r.counters[EXTERNAL_HITS]
                if meter:
                    r.cache = {k: v - metered.get(k, 0.0) for k, v in meter().items()}
                s = r.summary()
                log(
                    f"{name}{f' pass {p + 1}' if passes > 1 else ''} {wl}: {r.requests} requests in "
                    f"{r.duration_s:.1f} s, {s['tok_per_s']:.0f} tok/s, TTFT p50 {s['ttft_p50_ms']:.0f} ms, "
                    f"external hits {r.counters[EXTERNAL_HITS]:.0f} / {r.counters[EXTERNAL_QUERIES]:.0f} tokens, "
                    f"computed {r.counters[PROMPT_COMPUTED]:.0f}"
                    + (f", cache server CPU {r.cache['cpu_s']:.2f} s" if "cpu_s" in r.cache else "")
                    + (f", promotions {r.cache['promotions']:.0f}" if "promotions" in r.cache else "")
                    + (f", {r.failed} FAILED requests" if r.failed else "")
                )
                res[wl] = r
            out.append(res)
        return start_s, out
    finally:
        server.stop()


# -- one run of everything -------------------------------------------------------------------------


@dataclass
class RunLog:
    """What one run did besides its phases: the order it ran the units in and every settle."""

    run: int
    order: list[str]
    settles: list[dict[str, Any]] = field(default_factory=list)


def run_all(
    args: argparse.Namespace, work: Path, run: int, failures: list[str]
) -> tuple[list[Phase], RunLog]:
    """Every system, budget and phase once (and the floor), in this run's rotation of the order."""
    phases: list[Phase] = []
    order = rotated(plan(args.systems, args.budgets, args.floor), run, args.runs)
    record = RunLog(run, [str(u) for u in order])
    log(f"run {run + 1} order: {', '.join(record.order)}")

    def attempt(label: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # one system failing must not lose the others' figures
            log(f"FAILED {label}: {exc}")
            failures.append(
                f"run {run + 1} {label}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            )

    def none() -> None:
        start, res = serve_once(args, work, f"r{run}-none", args.blocks, None)
        phases.append(Phase("none", "–", "cold", run, start, res[0]))

    def floor() -> None:
        start, res = serve_once(args, work, f"r{run}-floor", floor_blocks(args), None, passes=2, cold=False)
        phases.append(Phase("floor", "–", "pass 1", run, start, res[0]))
        phases.append(Phase("floor", "–", "pass 2", run, start, res[1]))

    def cached(unit: Unit) -> None:
        system, budget = unit.system, unit.budget
        root = work / f"r{run}-{system}-{budget}"
        cache: CacheServer
        if system in TIERCACHE_SYSTEMS:
            cache = TierCacheServer(
                args.python,
                root,
                args.chunk_size,
                budget_gb(args, budget),
                tails=system != "tiercache-chunks",
                cpus=args.cache_pin,
                settings=args.connector_config,
            )
        elif system in LMCACHE_SYSTEMS:
            cache = LMCacheServer(
                args.python,
                root,
                args.chunk_size,
                budget_gb(args, budget),
                fs=system == "lmcache-fs",
                cpus=args.cache_pin,
            )
        else:
            cache = ExampleStore(root)
        t0 = time.perf_counter()
        cache.start()
        log(f"{unit}: cache ready in {time.perf_counter() - t0:.1f} s, L1 {cache.l1_gb} GB")
        ktc = cache.kv_transfer_config()
        try:
            phase_names = ["cold", "restart"]
            if system in TIERCACHE_SYSTEMS and budget == "full" and args.floor:
                phase_names.append("floor-sized restart")  # like for like with the floor's pass 2
            for phase in phase_names:
                name = f"r{run}-{system}-{budget}-{phase.replace(' ', '-')}"
                blocks = floor_blocks(args) if phase == "floor-sized restart" else args.blocks
                start, res = serve_once(
                    args, work, name, blocks, ktc, cold=phase == "cold", meter=cache.meter
                )
                if phase != phase_names[-1]:
                    # The same rule for every system before its next phase looks for what it stored.
                    settled = settle_cache(cache)
                    log(f"{unit} after {phase}: {settled.line()}")
                    record.settles.append(
                        {
                            "unit": str(unit),
                            "after": phase,
                            "waited_s": settled.waited_s,
                            "quiet": settled.quiet,
                        }
                        | ({"still_moving": list(settled.loud)} if settled.loud else {})
                    )
                stats = cache.stats()
                if isinstance(cache, TierCacheServer) and stats is not None:
                    log(f"{unit} after {phase}: {stored_line(stats)}")
                if phase == "floor-sized restart":
                    phases.append(Phase("floor", "full", f"{system} restart", run, start, res[0], stats))
                else:
                    phases.append(Phase(system, budget, phase, run, start, res[0], stats))
        finally:
            cache.stop()
            if not args.keep:
                for sub in ("disk", "fs", "store"):
                    shutil.rmtree(root / sub, ignore_errors=True)

    for unit in order:
        if unit.system == "none":
            attempt("none", none)
        elif unit.system == "floor":
            attempt("floor", floor)
        else:
            attempt(str(unit), functools.partial(cached, unit))
    return phases, record


# -- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--help`` explains each option."""
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="See the module docstring (and docs/benchmarks.md) for what each system, phase and row means.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    s = ap.add_argument_group("what to run")
    s.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="comma list of: none (no connector: vLLM's own prefix cache), tiercache (the connector's "
        "defaults: tails on), tiercache-chunks (tails off: whole chunks only), lmcache (MP, memory only), "
        "lmcache-fs (MP with the fs L2 adapter), example (vLLM's ExampleConnector)",
    )
    s.add_argument(
        "--workloads",
        default="prefix,chat",  # miss is run on its own (module docstring)
        help="comma list of: prefix (shared documents), chat (multi-turn), miss (unique prompts: cold phases only)",
    )
    s.add_argument(
        "--budgets",
        default=",".join(BUDGETS),
        help="comma list of cache-server L1 sizes: full (holds the working set, +25%%), third (a third of it)",
    )
    s.add_argument(
        "--runs", type=int, default=1, help="repeat everything with fresh servers; the table shows medians"
    )
    s.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the physical floor: an engine whose own KV cache holds the whole working set, the "
        "prompts twice, then a same-size engine restarting on the full tiercache server",
    )
    s.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send each fresh vLLM server one unrelated request before measuring (not counted)",
    )
    s.add_argument(
        "--quick",
        action="store_true",
        help="a few requests, systems none and tiercache, the prefix workload, the full budget, no floor (CI)",
    )
    s.add_argument(
        "--capacity",
        action="store_true",
        help="the restart's tail under a short cache: the prefix workload with 48 documents of 2048 tokens "
        "and 4 questions of 64 each (192 requests), 4 in flight, vLLM's cache 160 blocks, the third budget, "
        "no floor; systems tiercache and lmcache-fs unless --systems names others",
    )
    w = ap.add_argument_group("workload sizes (tokens)")
    w.add_argument("--docs", type=int, default=8, help="prefix: shared documents")
    w.add_argument("--doc-len", type=int, default=1024, help="prefix: tokens per document")
    w.add_argument(
        "--questions", type=int, default=6, help="prefix: questions per document (requests = docs × this)"
    )
    w.add_argument(
        "--question-len", type=int, default=64, help="prefix: tokens per question (after the document)"
    )
    w.add_argument("--users", type=int, default=6, help="chat: users, each with its own growing history")
    w.add_argument("--turns", type=int, default=3, help="chat: turns per user")
    w.add_argument("--first-len", type=int, default=640, help="chat: tokens of each user's first message")
    w.add_argument("--turn-len", type=int, default=96, help="chat: tokens of each follow-up message")
    w.add_argument("--miss-prompts", type=int, default=48, help="miss: unique prompts (cold phases only)")
    w.add_argument("--miss-len", type=int, default=1024, help="miss: tokens per unique prompt")
    w.add_argument(
        "--output-len", type=int, default=16, help="generated tokens per request (greedy, ignore_eos)"
    )
    w.add_argument("--concurrency", type=int, default=2, help="requests in flight at once")
    w.add_argument(
        "--seed", type=int, default=0, help="seed of the weights, the prompts and the load generator"
    )
    m = ap.add_argument_group("model and engine")
    m.add_argument("--hidden", type=int, default=512, help="hidden size of the tiny Llama (MLP 2×)")
    m.add_argument("--layers", type=int, default=8, help="decoder layers")
    m.add_argument("--heads", type=int, default=8, help="attention heads")
    m.add_argument("--kv-heads", type=int, default=4, help="KV heads")
    m.add_argument("--head-dim", type=int, default=64, help="head size")
    m.add_argument("--vocab", type=int, default=1024, help="vocabulary (word-level tokenizer t3 … tN)")
    m.add_argument("--block-size", type=int, default=32, help="vLLM block size (a multiple of 32 on CPU)")
    m.add_argument("--chunk-size", type=int, default=128, help="tiercache and LMCache chunk size")
    m.add_argument("--max-model-len", type=int, default=2048, help="vLLM --max-model-len")
    m.add_argument(
        "--blocks",
        type=int,
        default=96,
        help="vLLM's own KV cache in blocks (--num-gpu-blocks-override), below the working set; must "
        "hold --concurrency of the longest prompts",
    )
    m.add_argument(
        "--start-timeout-s", type=float, default=300.0, help="give up on a vLLM server start after this"
    )
    m.add_argument(
        "--engine-cpus",
        default="0",
        help="the CPUs every vLLM engine computes on, whatever the system (VLLM_CPU_OMP_THREADS_BIND: a "
        "list such as 0 or 0-3); 'auto' leaves vLLM to choose, which gives an engine with a connector "
        "more compute threads than one without",
    )
    add_pin_arguments(m)
    e = ap.add_argument_group("environments and output")
    e.add_argument(
        "--python",
        default=sys.executable,
        help="the one interpreter every server starts from (vLLM's for every system, tiercache's and "
        "LMCache's servers): a venv with vllm-cpu, tiercache and, for the LMCache systems, lmcache "
        "(docs/benchmarks.md, 'One install'); checked before anything starts",
    )
    e.add_argument(
        "--lmcache-python",
        default=None,
        help=argparse.SUPPRESS,  # gone: refused with a message saying why (see parse_args)
    )
    e.add_argument(
        "--json", type=Path, default=None, help="write the table, every sample and server stats here"
    )
    e.add_argument(
        "--png",
        type=Path,
        default=None,
        help="write the figure (TTFT distribution and throughput of every row) here; needs matplotlib "
        "(pip install -e '.[bench]'), skipped with a message without it",
    )
    e.add_argument("--keep", action="store_true", help="keep the work directory (model, logs, cache dirs)")
    e.add_argument(
        "--connector-config",
        type=json.loads,
        default={},
        metavar="JSON",
        help="more TierCacheConnector settings for every tiercache row, as a JSON object merged into "
        "kv_connector_extra_config (e.g. '{\"lookup_wait_s\": 0.05}'); printed with the results",
    )
    args = ap.parse_args(argv)
    if args.lmcache_python is not None:
        ap.error(
            "--lmcache-python is gone: LMCache in a venv of its own measured that venv's vLLM against "
            "tiercache's. Install lmcache next to tiercache and pass that venv's python as --python "
            "(docs/benchmarks.md, 'One install')"
        )
    if args.quick:
        args.systems, args.workloads, args.budgets, args.floor = "none,tiercache", "prefix", "full", False
        args.docs, args.questions, args.doc_len, args.question_len, args.output_len = 2, 2, 512, 32, 8
    if args.capacity:
        if args.systems == ap.get_default("systems"):
            args.systems = "tiercache,lmcache-fs"
        args.workloads, args.budgets, args.floor, args.concurrency = "prefix", "third", False, 4
        args.docs, args.doc_len, args.questions, args.question_len = 48, 2048, 4, 64
        args.blocks, args.max_model_len = 160, 2304
    args.systems = [x for x in args.systems.split(",") if x]
    args.workloads = [x for x in args.workloads.split(",") if x]
    args.budgets = [x for x in args.budgets.split(",") if x]
    for name, values, allowed in (
        ("--systems", args.systems, SYSTEMS),
        ("--workloads", args.workloads, WORKLOADS),
        ("--budgets", args.budgets, BUDGETS),
    ):
        if set(values) - set(allowed):
            ap.error(
                f"{name}: unknown {sorted(set(values) - set(allowed))}; choose from {', '.join(allowed)}"
            )
    if "tiercache" not in args.systems or "full" not in args.budgets:
        args.floor = False  # its restart row needs the full-budget tiercache server
    args.python = os.path.abspath(args.python)  # absolute, not resolved: a venv's python is a symlink
    return args


def write_json(
    args: argparse.Namespace,
    path: Path,
    install: Install,
    ws: int,
    load: list[float],
    runs: list[RunLog],
    phases: list[Phase],
    failures: list[str],
) -> None:
    """Everything measured so far (the table's rows and the targets from ``phases``) as JSON."""
    _, out_rows = table(rows_of(phases))
    path.write_text(
        json.dumps(
            {
                "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "working_set_tokens": ws,
                "budgets_gb": {b: budget_gb(args, b) for b in args.budgets},
                "floor_blocks": floor_blocks(args),
                "runs_done": len(runs),
                "load_average_after_each_run": load,
                "install": {"python": install.python, "versions": install.versions},
                "runs": [{"run": r.run, "order": r.order, "settles": r.settles} for r in runs],
                "rows": out_rows,
                "targets": [g.as_dict() for g in targets(phases)],
                "failures": failures,
                "phases": [
                    {
                        "system": p.system,
                        "budget": p.budget,
                        "phase": p.phase,
                        "run": p.run,
                        "start_s": p.start_s,
                    }
                    for p in phases
                ],
            },
            indent=1,
            default=str,
        )
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every system ran, 1 when one failed, 2 on a wrong environment."""
    args = parse_args(argv)
    try:
        import vllm.benchmarks.serve  # noqa: F401  (the load generator runs in this process)
    except ImportError:
        print(
            "error: run with a venv that has vLLM (.venv-serve/bin/python benchmarks/serve.py)",
            file=sys.stderr,
        )
        return 2
    # One install for every system: what each needs must import from --python, before anything starts.
    checked = [*args.systems, *(["floor"] if args.floor else [])]
    try:
        install = probe_install(args.python, checked, REPO)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problems = install_problems(install, checked, REPO)
    if problems:
        print(install_error(args.python, problems), file=sys.stderr)
        return 2
    log(install.line())
    try:
        args.engine_pin, args.cache_pin = placement(args.engine_cpus, args.pin)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.cache_pin:
        os.sched_setaffinity(0, cpu_set(args.cache_pin))  # the load generator runs in this process
    log(
        f"every vLLM engine computes on CPUs {args.engine_cpus} (VLLM_CPU_OMP_THREADS_BIND)"
        + (f"; vLLM servers run on CPUs {args.engine_pin} (taskset)" if args.engine_pin else "")
        + (f"; cache servers and the load generator on {args.cache_pin} (taskset)" if args.cache_pin else "")
        if args.engine_cpus != "auto"
        else "vLLM chooses each engine's CPUs (--engine-cpus auto): a connector adds a compute thread"
    )

    from tiercache.testing.checkpoints import tiny_llama_config, write_tiny_checkpoint, write_tokenizer

    work = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    cfg = tiny_llama_config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_model_len,
    )
    write_tiny_checkpoint(work / "model", cfg, args.seed)
    write_tokenizer(work / "model", args.vocab)
    ws = working_set_tokens(args)
    log(
        f"work dir {work}; working set {ws} tokens = {ws * kv_bytes_per_token(args) / MiB:.0f} MiB of KV; "
        f"vLLM capped at {args.blocks} blocks ({args.blocks * args.block_size} tokens); budgets "
        + ", ".join(f"{b} {budget_gb(args, b)} GB" for b in args.budgets)
        + f"; load average {os.getloadavg()[0]:.2f}"
    )
    failures: list[str] = []
    phases: list[Phase] = []
    runs: list[RunLog] = []
    load: list[float] = []
    t0 = time.perf_counter()
    for run in range(args.runs):
        log(f"run {run + 1}/{args.runs}")
        got, record = run_all(args, work, run, failures)
        phases += got
        runs.append(record)
        load.append(os.getloadavg()[0])
        if args.json is not None and run + 1 < args.runs:
            # The runs so far, so an interrupted benchmark (these take hours) keeps what it measured.
            write_json(args, args.json, install, ws, load, runs, phases, failures)
            log(f"wrote {args.json} (runs 1-{run + 1} of {args.runs})")
    rows = rows_of(phases)
    text, _ = table(rows)
    title = (
        f"Serving benchmark: {args.runs} run(s), medians; tiny Llama hidden {args.hidden}, {args.layers} layers, "
        f"float32, block {args.block_size}, chunk {args.chunk_size}; vLLM KV capped at {args.blocks} blocks "
        f"(floor: {floor_blocks(args)}); working set {ws} tokens; concurrency {args.concurrency}; "
        f"every system on {install.vllm_version()}, engine CPUs {args.engine_cpus}"
        + (
            f" (vLLM servers on {args.engine_pin}, cache servers on {args.cache_pin})"
            if args.cache_pin
            else ""
        )
        + (
            f"; tiercache connector settings {json.dumps(args.connector_config)}"
            if args.connector_config
            else ""
        )
        + f"; {time.perf_counter() - t0:.0f} s"
    )
    print(title + "\n")
    print(text)
    goals = targets(phases)
    if goals:
        print("\nTargets (each a ratio within every run; the value is the median of the runs' ratios):\n")
        print(format_targets(goals))
    failed_rows = [f"{r.workload} {r.system} {r.budget} {r.phase}" for r in rows if r.failed]
    failures += [f"failed requests in {name}" for name in failed_rows]
    for line in [f"FAILED: {f}" for f in failures]:
        print(f"\n{line}")
    if args.png is not None:
        log(write_figure(rows, args.png, title))
    if args.json is not None:
        write_json(args, args.json, install, ws, load, runs, phases, failures)
        log(f"wrote {args.json}")
    if args.keep:
        log(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
