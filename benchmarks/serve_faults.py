"""Soak and faults under serving: vLLM's OpenAI server through a tiercache server (l1, disk) under load.

Not run in CI (minutes per scenario); ``tests/e2e`` covers the short versions. Run from the repo root
with the vLLM venv::

    .venv-vllm/bin/python -m benchmarks.serve_faults --scenarios soak,kill,hang --json faults.json

The workload: ``--documents`` shared documents (``--document-tokens`` each), ``--questions`` per
document (``--question-tokens`` each; by default each prompt also has a full chunk of its own), every prompt a document followed by one of its questions,
sent ``--repeats`` times in a shuffled order by ``--concurrency`` concurrent clients (greedy,
``ignore_eos``, ``--max-tokens`` tokens). vLLM's own KV cache is capped (``--engine-blocks``) far
below the working set and tiercache's L1 holds a third of it or less (``--l1-mib``), so most hits
come through the tiers, many from disk. A reference engine without a connector answers every
distinct prompt once first: every answer under load must equal its answer.

Scenarios (each on a fresh tiercache server, disk in a temporary directory, and a fresh vLLM server):

* ``soak``: the whole load; at the end the server must hold 0 leases, 0 reservations and 0 tickets,
  report 0 verify failures, and its peak RSS is printed;
* ``kill``: ``kill -9`` of the tiercache server a third of the way through, a new one on the same
  disk ``--down-s`` seconds later; vLLM is never restarted: no request may fail, every answer must
  be right, and the time from the new server's start to the first request served from it is printed;
* ``hang``: the tiercache server is stopped (``SIGSTOP``: every reply is late, forever) a third of
  the way through for ``--hang-s`` seconds, then resumed; request latency during the hang is printed
  against the reference engine's (no connector), and no request may hang.

Progress goes to stderr, the tables to stdout; exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import progress
from tests.e2e.engine_run import write_served_tiny_llama
from tests.e2e.openai_server import OpenAIServer, api_server_argv, tiny_model_flags
from tests.reliability.common import peak_rss_mib
from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.testing.checkpoints import token_text

MiB = 1 << 20
CHUNK = 64
VOCAB = 512


log = progress("serve_faults")


@dataclass(frozen=True)
class Answer:
    """One request's outcome: when it was sent and answered (monotonic seconds), its text, how many
    prompt tokens the engine did not compute, and the error if it failed."""

    index: int
    sent: float
    done: float
    text: str = ""
    cached_tokens: int = 0
    error: str = ""

    @property
    def seconds(self) -> float:
        return self.done - self.sent


@dataclass
class Report:
    """What one scenario measured and whether its checks held."""

    scenario: str
    requests: int = 0
    failed: int = 0
    wrong: int = 0
    seconds: float = 0.0
    cached_share: float = 0.0  # prompt tokens not computed / prompt tokens, over all requests
    p50_s: float = 0.0
    p99_s: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def make_workload(args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts (token ids) and the order requests send them in (indices, shuffled)."""
    rng = random.Random(args.seed)
    prompts = []
    for _ in range(args.documents):
        document = [rng.randrange(3, VOCAB) for _ in range(args.document_tokens)]
        for _ in range(args.questions):
            prompts.append(document + [rng.randrange(3, VOCAB) for _ in range(args.question_tokens)])
    order = [i for i in range(len(prompts)) for _ in range(args.repeats)]
    rng.shuffle(order)
    return prompts, order


def working_set_chunks(prompts: Sequence[Sequence[int]]) -> int:
    """Distinct full chunks the prompts store (shared document chunks once)."""
    return len({tuple(p[: k * CHUNK]) for p in prompts for k in range(1, len(p) // CHUNK + 1)})


def engine_argv(model: Path, args: argparse.Namespace, endpoint: str | None) -> list[str]:
    """An OpenAI server for the model; with ``endpoint``, through tiercache (plugin name only)."""
    flags = tiny_model_flags(args.engine_blocks)
    if endpoint is not None:
        transfer = {
            "kv_connector": "TierCacheConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"server": endpoint, "retry_s": args.retry_s},
        }
        flags.append(f"--kv-transfer-config={json.dumps(transfer)}")
    return api_server_argv(model, *flags)


def send_all(
    url: str,
    prompts: Sequence[str],
    order: Sequence[int],
    args: argparse.Namespace,
    on_progress: Callable[[int], None] | None = None,
) -> list[Answer]:
    """Send ``order``'s prompts with ``args.concurrency`` clients; every request's :class:`Answer`.
    ``on_progress(n)`` runs (on a client thread) after the n-th answer."""
    local = threading.local()
    lock = threading.Lock()
    answered = [0]

    def one(i: int) -> Answer:
        http = getattr(local, "http", None)
        if http is None:
            http = local.http = httpx.Client(base_url=url, timeout=args.request_timeout_s)
        sent = time.monotonic()
        body = {
            "model": str(args.model_dir),
            "prompt": prompts[order[i]],
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        try:
            r = http.post("/v1/completions", json=body)
            if r.status_code != 200:
                answer = Answer(i, sent, time.monotonic(), error=f"HTTP {r.status_code}: {r.text[:200]}")
            else:
                data = r.json()
                details = data["usage"].get("prompt_tokens_details") or {}
                answer = Answer(
                    i,
                    sent,
                    time.monotonic(),
                    data["choices"][0]["text"],
                    int(details.get("cached_tokens") or 0),
                )
        except httpx.HTTPError as exc:
            answer = Answer(i, sent, time.monotonic(), error=f"{type(exc).__name__}: {exc}")
        with lock:
            answered[0] += 1
            n = answered[0]
        if on_progress is not None:
            on_progress(n)
        return answer

    with ThreadPoolExecutor(args.concurrency) as pool:
        return list(pool.map(one, range(len(order))))


def summarize(
    report: Report, answers: list[Answer], order: Sequence[int], expected: Sequence[str], prompt_tokens: int
) -> None:
    """Fill ``report``'s counts and latencies from ``answers`` (expected text per distinct prompt)."""
    report.requests = len(answers)
    report.failed = sum(1 for a in answers if a.error)
    report.wrong = sum(1 for a in answers if not a.error and a.text != expected[order[a.index]])
    report.seconds = max(a.done for a in answers) - min(a.sent for a in answers)
    report.cached_share = sum(a.cached_tokens for a in answers) / (prompt_tokens * len(answers))
    latencies = sorted(a.seconds for a in answers)
    report.p50_s = statistics.median(latencies)
    report.p99_s = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    if report.failed:
        report.problems.append(
            f"{report.failed} failed requests, e.g. {next(a.error for a in answers if a.error)}"
        )
    if report.wrong:
        report.problems.append(f"{report.wrong} answers differ from the reference engine's")


def tiercache_spec(tmp: Path, args: argparse.Namespace) -> ServerSpec:
    return ServerSpec(
        listen=f"ipc://{tmp}/server.sock",
        l1_bytes=args.l1_mib * MiB,
        disk_path=str(tmp / "disk"),
        disk_budget=args.disk_mib * MiB,
        options={"chunk_size": CHUNK},
    )


def server_checks(server: ServerProcess, report: Report) -> None:
    """At the end of a load: nothing held, nothing corrupt; the server's peak RSS."""
    with server.client() as client:
        stats = client.stats()
    held = {k: stats["server"][k] for k in ("leases", "reservations", "tickets")}
    report.figures["held_at_end"] = held
    if any(held.values()):
        report.problems.append(f"the server still holds {held} after the load")
    verify = {name: t.get("verify_failures", 0) for name, t in stats["tiers"].items()}
    report.figures["verify_failures"] = verify
    if any(verify.values()):
        report.problems.append(f"verify failures {verify}")
    report.figures["server_peak_rss_mib"] = round(peak_rss_mib(server.process.pid), 1)
    report.figures["engine"] = {
        k: stats["engine"][k]
        for k in ("lookups", "lookup_chunks_hit", "stores", "promotions", "stores_dropped")
    }
    report.figures["tiers"] = {
        name: {k: t.get(k) for k in ("objects", "bytes_used", "hits", "misses")}
        for name, t in stats["tiers"].items()
    }


def reference(
    model: Path, prompts: list[str], args: argparse.Namespace, tmp: Path
) -> tuple[list[str], list[Answer]]:
    """Every distinct prompt answered once by an engine without a connector (the expected texts), and
    the latencies of the same load shape on it (the no-connector baseline of the hang scenario)."""
    log("reference engine (no connector): answering every distinct prompt once")
    with OpenAIServer(engine_argv(model, args, None), tmp / "reference.log") as vllm:
        once = send_all(vllm.url, prompts, list(range(len(prompts))), args)
        failed = [a for a in once if a.error]
        if failed:
            raise SystemExit(f"the reference engine failed {len(failed)} requests: {failed[0].error}")
    return [a.text for a in once], once


def run_scenario(
    name: str,
    model: Path,
    prompts: list[str],
    order: list[int],
    expected: list[str],
    args: argparse.Namespace,
    tmp: Path,
) -> Report:
    report = Report(name)
    work = tmp / name
    work.mkdir()
    spec = tiercache_spec(work, args)
    servers = [ServerProcess(spec)]
    servers[0].wait_ready()
    prompt_tokens = args.document_tokens + args.question_tokens
    fault_at = len(order) // 3
    events: dict[str, float] = {}
    timers: list[threading.Timer] = []  # the restart / resume, joined before the final checks

    def progress(n: int) -> None:
        if n % max(1, len(order) // 10) == 0:
            log(f"{name}: {n}/{len(order)} answered")
        if n != fault_at:
            return
        if name == "kill":
            events["killed"] = time.monotonic()
            os.kill(servers[-1].process.pid, signal.SIGKILL)
            log(f"kill: kill -9 of the tiercache server after {n} answers; a new one in {args.down_s:g} s")
            timers.append(threading.Timer(args.down_s, restart))
            timers[-1].start()
        elif name == "hang":
            events["stopped"] = time.monotonic()
            os.kill(servers[-1].process.pid, signal.SIGSTOP)
            log(f"hang: tiercache server stopped (SIGSTOP) after {n} answers, for {args.hang_s:g} s")
            timers.append(threading.Timer(args.hang_s, resume))
            timers[-1].start()

    def restart() -> None:
        servers[-1].process.join(10)
        fresh = ServerProcess(spec)
        fresh.wait_ready()
        events["restarted"] = time.monotonic()
        servers.append(fresh)
        log("kill: the new tiercache server is ready")

    def resume() -> None:
        os.kill(servers[-1].process.pid, signal.SIGCONT)
        events["resumed"] = time.monotonic()
        log("hang: tiercache server resumed (SIGCONT)")

    log(f"{name}: vLLM OpenAI server through tiercache (L1 {args.l1_mib} MiB + disk)")
    try:
        with OpenAIServer(engine_argv(model, args, spec.listen), work / "vllm.log") as vllm:
            answers = send_all(vllm.url, prompts, order, args, progress)
            for timer in timers:
                timer.join()
            summarize(report, answers, order, expected, prompt_tokens)
            if name != "soak" and events.get("restarted", events.get("resumed", 0)) > max(
                a.sent for a in answers
            ):
                report.problems.append("the load ended before the server came back: send more requests")
            if name == "kill":
                restarted = events.get("restarted")
                if restarted is None:
                    report.problems.append("the tiercache server was never restarted")
                else:
                    served = [a for a in answers if a.sent >= restarted and a.cached_tokens > CHUNK]
                    report.figures["seconds_to_first_hit_after_restart"] = (
                        round(min(a.done for a in served) - restarted, 2) if served else None
                    )
                    if not served:
                        report.problems.append("no hit after the tiercache server came back")
            if name == "hang":
                stopped, resumed = events.get("stopped"), events.get("resumed")
                if stopped and resumed:
                    during = sorted(a.seconds for a in answers if stopped <= a.sent < resumed)
                    report.figures["during_hang"] = {
                        "requests": len(during),
                        "p50_s": round(statistics.median(during), 3) if during else None,
                        "max_s": round(max(during), 3) if during else None,
                    }
            server_checks(servers[-1], report)
    finally:
        for server in servers:
            try:
                os.kill(server.process.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            server.stop()
    return report


def print_tables(reports: list[Report], baseline: list[Answer]) -> None:
    base = sorted(a.seconds for a in baseline)
    print(f"\nreference engine (no connector): request p50 {statistics.median(base):.3f} s")
    print(
        f"{'scenario':<8} {'requests':>8} {'failed':>6} {'wrong':>5} {'seconds':>8} {'req/s':>6} "
        f"{'cached':>7} {'p50 s':>6} {'p99 s':>6}  checks"
    )
    for r in reports:
        print(
            f"{r.scenario:<8} {r.requests:>8} {r.failed:>6} {r.wrong:>5} {r.seconds:>8.1f} "
            f"{r.requests / r.seconds if r.seconds else 0:>6.1f} {r.cached_share:>7.1%} {r.p50_s:>6.3f} "
            f"{r.p99_s:>6.3f}  {'ok' if not r.problems else '; '.join(r.problems)}"
        )
        for key, value in r.figures.items():
            print(f"    {key}: {value}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="soak,kill,hang", help="comma-separated: soak, kill, hang")
    ap.add_argument("--documents", type=int, default=50, help="shared documents (default 50)")
    ap.add_argument("--document-tokens", type=int, default=192, help="tokens per document (default 192)")
    ap.add_argument("--questions", type=int, default=4, help="questions per document (default 4)")
    ap.add_argument("--question-tokens", type=int, default=100, help="tokens per question (default 100)")
    ap.add_argument("--repeats", type=int, default=10, help="times each prompt is sent (default 10)")
    ap.add_argument("--concurrency", type=int, default=8, help="concurrent clients (default 8)")
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request (default 4)")
    ap.add_argument(
        "--engine-blocks", type=int, default=128, help="vLLM's own KV cache in 32-token blocks (default 128)"
    )
    ap.add_argument("--l1-mib", type=int, default=6, help="tiercache L1 (default 6 MiB: < 1/3 of the set)")
    ap.add_argument("--disk-mib", type=int, default=512, help="tiercache disk tier budget (default 512 MiB)")
    ap.add_argument("--retry-s", type=float, default=1.0, help="connector reconnect interval (default 1)")
    ap.add_argument("--down-s", type=float, default=3.0, help="kill: seconds before the new server starts")
    ap.add_argument("--hang-s", type=float, default=15.0, help="hang: seconds the server stays stopped")
    ap.add_argument("--request-timeout-s", type=float, default=120.0, help="a request slower fails")
    ap.add_argument("--seed", type=int, default=5, help="workload seed")
    ap.add_argument("--json", type=Path, help="write every figure here")
    args = ap.parse_args(argv)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(args.scenarios) - {"soak", "kill", "hang"}
    if unknown:
        ap.error(f"unknown scenarios {sorted(unknown)}; choose from soak, kill, hang")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tiercache-serve-faults-") as d:
        tmp = Path(d)
        args.model_dir = tmp / "model"
        write_served_tiny_llama(args.model_dir, seed=1234)
        token_prompts, order = make_workload(args)
        prompts = [token_text(p) for p in token_prompts]
        chunk_bytes = 2 * 2 * 2 * 32 * 4 * CHUNK  # layers x K/V x kv heads x head dim x fp32 x tokens
        working_set = working_set_chunks(token_prompts) * chunk_bytes
        log(
            f"{len(prompts)} distinct prompts, {len(order)} requests, working set ~{working_set / MiB:.0f} MiB "
            f"(L1 {args.l1_mib} MiB: {working_set / (args.l1_mib * MiB):.1f}x)"
        )
        expected, baseline = reference(args.model_dir, prompts, args, tmp)
        reports = [
            run_scenario(s, args.model_dir, prompts, order, expected, args, tmp) for s in args.scenarios
        ]
    print_tables(reports, baseline)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in reports], indent=1))
    return 1 if any(r.problems for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
