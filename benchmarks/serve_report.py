"""The serving benchmark's report: rows (medians over runs), the table and the targets.

Pure: no vLLM, no HTTP, no processes. ``benchmarks/serve.py`` runs the servers and feeds these
functions the :class:`Phase` of every vLLM server it ran; ``tests/benchmarks/test_serve_report.py``
feeds them made-up phases.

Each target (:data:`TARGETS`, the one table of bounds) is a ratio of one phase's figure to another's,
computed **within each run** (both phases from the same run, so the machine's drift between runs
cancels); its value is the median of the runs' ratios, and its verdict, printed by
:func:`format_targets`, is ``MET`` or ``MISSED`` by that median, or ``FAILED`` when a run lacks one
of the phases or one of them had a failed request (its figures then mean nothing).

A bound is never changed in the commit that publishes results measured against it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Literal

WORKLOADS = ("prefix", "chat", "miss")
#: Prompt tokens vLLM computed itself (neither its prefix cache nor a connector supplied them): the
#: ``local_compute`` source of ``vllm:prompt_tokens_by_source``, a key of ``WorkloadResult.counters``.
PROMPT_COMPUTED = "vllm:prompt_tokens_by_source_total{source=local_compute}"
#: Requests vLLM preempted (their KV freed for want of blocks, recomputed or reloaded later): a
#: capped engine's tail, a key of ``WorkloadResult.counters``.
PREEMPTIONS = "vllm:num_preemptions_total"
#: tiercache's connector (docs/vllm.md, "Metrics"): requests vLLM held back a step or more for their
#: lookup, and the lookups' waits from send until the scheduler could answer (sum and count).
LOOKUPS_DEFERRED = "vllm:tiercache_lookups_deferred_total"
LOOKUP_SECONDS_SUM = "vllm:tiercache_lookup_seconds_sum"
LOOKUP_SECONDS_COUNT = "vllm:tiercache_lookup_seconds_count"
LMCACHE_SYSTEMS = ("lmcache", "lmcache-fs")
#: The system of a :class:`Side` that stands for the faster (by tok/s) LMCache system of that run.
LMCACHE_BEST = "lmcache best"


@dataclass
class WorkloadResult:
    """One workload on one vLLM server: per-request TTFTs (s) and texts, and the totals."""

    workload: str
    duration_s: float
    requests: int
    failed: int
    total_tokens: int
    ttfts: list[float]
    texts: list[str]
    counters: dict[str, float] = field(default_factory=dict)  # vLLM /metrics deltas over the workload
    external_hits: float = 0.0  # prompt tokens a KV connector served (vLLM's external prefix cache hits)
    #: The cache server's deltas over the workload: ``cpu_s`` (its process tree's CPU seconds) and,
    #: for tiercache, ``promotions`` (chunks copied up from disk into L1); empty without one.
    cache: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        """Requests/s, total tokens/s, TTFT percentiles in ms, the prompt tokens vLLM computed and the
        cache server's CPU milliseconds per request and per promoted chunk (NaN where not read)."""
        ms = sorted(t * 1e3 for t in self.ttfts)
        cpu_ms = self.cache.get("cpu_s", math.nan) * 1e3
        promotions = self.cache.get("promotions", 0.0)
        return {
            "prompt_tokens_computed": self.counters.get(PROMPT_COMPUTED, float("nan")),
            "preemptions": self.counters.get(PREEMPTIONS, float("nan")),
            "lookups_deferred": self.counters.get(LOOKUPS_DEFERRED, float("nan")),
            "lookup_wait_mean_ms": (
                self.counters[LOOKUP_SECONDS_SUM] * 1e3 / self.counters[LOOKUP_SECONDS_COUNT]
                if self.counters.get(LOOKUP_SECONDS_COUNT)
                else float("nan")
            ),
            "req_per_s": self.requests / self.duration_s,
            "tok_per_s": self.total_tokens / self.duration_s,
            "ttft_p50_ms": percentile(ms, 50),
            "ttft_p90_ms": percentile(ms, 90),
            "ttft_p99_ms": percentile(ms, 99),
            "ttft_mean_ms": statistics.fmean(ms) if ms else float("nan"),
            "cache_cpu_ms_per_request": cpu_ms / self.requests if self.requests else math.nan,
            "cache_cpu_ms_per_promotion": cpu_ms / promotions if promotions else math.nan,
        }


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of already sorted values."""
    if not sorted_values:
        return float("nan")
    k = (len(sorted_values) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


@dataclass
class Phase:
    """What one vLLM server did: per workload results, its start time and the cache server's stats."""

    system: str
    budget: str
    phase: str
    run: int
    start_s: float
    results: dict[str, WorkloadResult]
    cache_stats: dict[str, Any] | None = None


# -- rows and the table ----------------------------------------------------------------------------


@dataclass
class Row:
    """Medians over runs of one (workload, system, budget, phase); ``failed`` sums failed requests."""

    workload: str
    system: str
    budget: str
    phase: str
    metrics: dict[str, float]
    ext_hits: float
    same_as_none: str
    failed: int
    samples: list[dict[str, Any]]


def rows_of(phases: list[Phase]) -> list[Row]:
    """Aggregate phases into rows (medians over runs), with outputs compared with ``none``'s run."""
    none_texts: dict[tuple[int, str], list[str]] = {
        (p.run, wl): r.texts for p in phases if p.system == "none" for wl, r in p.results.items()
    }
    keys: dict[tuple[str, str, str, str], list[Phase]] = {}
    for p in phases:
        for wl in p.results:
            keys.setdefault((wl, p.system, p.budget, p.phase), []).append(p)
    rows = []
    for (wl, system, budget, phase), ps in keys.items():
        sums = [p.results[wl].summary() for p in ps]
        med = {k: statistics.median(s[k] for s in sums) for k in sums[0]}
        equal, total = 0, 0
        for p in ps:
            ref = none_texts.get((p.run, wl))
            if ref is not None:
                texts = p.results[wl].texts
                equal += sum(a == b for a, b in zip(texts, ref))
                total += len(ref)
        samples = [
            {
                "run": p.run,
                "start_s": p.start_s,
                **p.results[wl].summary(),
                "requests": p.results[wl].requests,
                "failed": p.results[wl].failed,
                "duration_s": p.results[wl].duration_s,
                "counters": p.results[wl].counters,
                "cache_deltas": p.results[wl].cache,
                "ttfts_s": p.results[wl].ttfts,
                "texts": p.results[wl].texts,
                "cache_server_stats": p.cache_stats,
            }
            for p in ps
        ]
        ext = statistics.median(p.results[wl].external_hits for p in ps)
        failed = sum(p.results[wl].failed for p in ps)
        rows.append(
            Row(wl, system, budget, phase, med, ext, f"{equal}/{total}" if total else "–", failed, samples)
        )
    return rows


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or ``None`` when either is missing or ``b`` is 0."""
    return a / b if a is not None and b else None


def fmt(v: float | None, spec: str = ".2f", suffix: str = "") -> str:
    """A figure for the table: ``–`` for a missing or NaN value."""
    return "–" if v is None or v != v else f"{v:{spec}}{suffix}"


def table(rows: list[Row]) -> tuple[str, list[dict[str, Any]]]:
    """The markdown table and its rows as dicts (ratios included) for the JSON.

    The ratio columns divide this row's medians by the other row's medians; the targets
    (:func:`targets`) divide within each run instead."""

    def find(wl: str, system: str, budget: str, phase: str) -> Row | None:
        return next(
            (r for r in rows if (r.workload, r.system, r.budget, r.phase) == (wl, system, budget, phase)),
            None,
        )

    lines = [
        "| workload | system | budget | phase | req/s | tok/s | TTFT p50 ms | p90 | p99 | mean | "
        "tok/s ÷ none | tok/s ÷ LMCache best | p50 ÷ LMCache best | p99 ÷ LMCache best | external hit tokens | "
        "computed prompt tokens | preemptions | lookups deferred | lookup wait mean ms | cache CPU ms / request | "
        "/ promoted chunk | outputs = none | failed requests |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    out = []
    for r in rows:
        none = find(r.workload, "none", "–", "cold")
        lmc = [x for s in LMCACHE_SYSTEMS if (x := find(r.workload, s, r.budget, r.phase)) is not None]
        best = (
            max(lmc, key=lambda x: x.metrics["tok_per_s"])
            if lmc and r.system not in ("none", "floor")
            else None
        )
        m = r.metrics
        vs_none = ratio(m["tok_per_s"], none.metrics["tok_per_s"]) if none else None
        vs_lmc = ratio(m["tok_per_s"], best.metrics["tok_per_s"]) if best else None
        p50_lmc = ratio(m["ttft_p50_ms"], best.metrics["ttft_p50_ms"]) if best else None
        p99_lmc = ratio(m["ttft_p99_ms"], best.metrics["ttft_p99_ms"]) if best else None
        lines.append(
            f"| {r.workload} | {r.system} | {r.budget} | {r.phase} | {fmt(m['req_per_s'])} | {fmt(m['tok_per_s'], '.0f')} | "
            f"{fmt(m['ttft_p50_ms'], '.0f')} | {fmt(m['ttft_p90_ms'], '.0f')} | {fmt(m['ttft_p99_ms'], '.0f')} | "
            f"{fmt(m['ttft_mean_ms'], '.0f')} | {fmt(vs_none, '.2f', '×')} | "
            f"{fmt(vs_lmc, '.2f', '×')}{f' ({best.system})' if best else ''} | {fmt(p50_lmc, '.2f', '×')} | "
            f"{fmt(p99_lmc, '.2f', '×')} | {r.ext_hits:.0f} | {fmt(m['prompt_tokens_computed'], '.0f')} | "
            f"{fmt(m['preemptions'], '.0f')} | {fmt(m['lookups_deferred'], '.0f')} | "
            f"{fmt(m['lookup_wait_mean_ms'], '.1f')} | {fmt(m['cache_cpu_ms_per_request'], '.1f')} | {fmt(m['cache_cpu_ms_per_promotion'], '.2f')} | "
            f"{r.same_as_none} | "
            f"{f'{r.failed} FAILED' if r.failed else '0'} |"
        )
        out.append(
            {
                "workload": r.workload,
                "system": r.system,
                "budget": r.budget,
                "phase": r.phase,
                **m,
                "tok_per_s_vs_none": vs_none,
                "lmcache_best": best.system if best else None,
                "tok_per_s_vs_lmcache_best": vs_lmc,
                "ttft_p50_vs_lmcache_best": p50_lmc,
                "ttft_p99_vs_lmcache_best": p99_lmc,
                "external_hit_tokens": r.ext_hits,
                "outputs_equal_none": r.same_as_none,
                "failed_requests": r.failed,
                "samples": r.samples,
            }
        )
    return "\n".join(lines), out


# -- targets ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Side:
    """One phase a target reads: ``system`` may be :data:`LMCACHE_BEST`."""

    system: str
    budget: str
    phase: str

    def __str__(self) -> str:
        return f"{self.system} {self.budget} {self.phase}"


#: How a target's ratio meets its bound: at least, at most, or exactly (equal figures).
Compare = Literal[">=", "<=", "=="]
_SYMBOL: dict[str, str] = {">=": "≥", "<=": "≤", "==": "="}


@dataclass(frozen=True)
class Target:
    """``metric`` of ``num`` ÷ the same metric of ``den``, within one run, against ``bound``."""

    name: str
    metric: str  # a key of WorkloadResult.summary()
    num: Side
    den: Side
    bound: float
    compare: Compare
    workloads: tuple[str, ...] = ("prefix", "chat")  # the workloads it is checked on

    @property
    def bound_text(self) -> str:
        """``≥ 0.95``, ``≤ 1.00`` or ``= 1.00`` (equal)."""
        return f"{_SYMBOL[self.compare]} {self.bound:.2f}"

    def met(self, value: float) -> bool:
        """Whether one ratio meets the bound."""
        if self.compare == ">=":
            return value >= self.bound
        if self.compare == "<=":
            return value <= self.bound
        return value == self.bound


#: The floor's second pass: an engine holding the whole working set, running the prompts again.
_FLOOR_PASS2 = Side("floor", "–", "pass 2")
#: A fresh engine of the floor's size restarting on the full-budget tiercache server.
_FLOOR_TC = Side("floor", "full", "tiercache restart")
_TC_THIRD_RESTART = Side("tiercache", "third", "restart")
_TC_THIRD_COLD = Side("tiercache", "third", "cold")
_LMC_THIRD_RESTART = Side(LMCACHE_BEST, "third", "restart")
_LMC_THIRD_COLD = Side(LMCACHE_BEST, "third", "cold")

#: The serving targets, each checked on the workloads it names (prefix and chat unless it says): the one table of their
#: bounds (docs/benchmarks.md prints the same). The LMCache rows ran from the same vLLM install as
#: tiercache's (``benchmarks/serve_plan.py`` checks it before anything starts).
TARGETS: tuple[Target, ...] = (
    Target(  # nothing recomputed that the floor's own prefix cache did not recompute
        name="floor-sized restart: prompt tokens computed vs pass 2",
        metric="prompt_tokens_computed",
        num=_FLOOR_TC,
        den=_FLOOR_PASS2,
        bound=1.00,
        compare="==",
    ),
    Target(
        name="floor-sized restart: mean TTFT ÷ pass 2",
        metric="ttft_mean_ms",
        num=_FLOOR_TC,
        den=_FLOOR_PASS2,
        bound=1.00,
        compare="<=",
    ),
    Target(
        name="floor-sized restart: tok/s ÷ pass 2",
        metric="tok_per_s",
        num=_FLOOR_TC,
        den=_FLOOR_PASS2,
        bound=0.95,
        compare=">=",
    ),
    Target(
        name="third: restart tok/s ÷ LMCache best",
        metric="tok_per_s",
        num=_TC_THIRD_RESTART,
        den=_LMC_THIRD_RESTART,
        bound=1.15,
        compare=">=",
    ),
    Target(
        name="third: restart TTFT p50 ÷ LMCache best",
        metric="ttft_p50_ms",
        num=_TC_THIRD_RESTART,
        den=_LMC_THIRD_RESTART,
        bound=0.80,
        compare="<=",
    ),
    Target(  # the slowest requests of a restart too, not only the typical one
        name="third: restart TTFT p99 ÷ LMCache best",
        metric="ttft_p99_ms",
        num=_TC_THIRD_RESTART,
        den=_LMC_THIRD_RESTART,
        bound=1.00,
        compare="<=",
    ),
    Target(  # "no worse than LMCache's (±5%)": faster is no miss
        name="third: cold tok/s ÷ LMCache best",
        metric="tok_per_s",
        num=_TC_THIRD_COLD,
        den=_LMC_THIRD_COLD,
        bound=0.95,
        compare=">=",
    ),
    Target(  # a miss costs nothing: unique prompts, no reuse, the engine's KV never short
        name="cold tok/s ÷ none",
        metric="tok_per_s",
        num=Side("tiercache", "full", "cold"),
        den=Side("none", "–", "cold"),
        bound=0.99,
        compare=">=",
        workloads=("miss",),
    ),
    Target(
        name="cold mean TTFT ÷ none",
        metric="ttft_mean_ms",
        num=Side("tiercache", "full", "cold"),
        den=Side("none", "–", "cold"),
        bound=1.02,
        compare="<=",
        workloads=("miss",),
    ),
)


@dataclass(frozen=True)
class RunValue:
    """A target's ratio in one run; ``value`` is ``None`` and ``failed`` says why when it has none."""

    run: int
    value: float | None
    versus: str  # the denominator's system (which LMCache system was the best in this run)
    failed: str | None = None
    num: float | None = None  # the two figures divided (shown for an equality target)
    den: float | None = None


@dataclass(frozen=True)
class TargetResult:
    """One target on one workload: every run's ratio, their median and the verdict."""

    workload: str
    target: Target
    runs: tuple[RunValue, ...]

    @property
    def median(self) -> float | None:
        """The median of the runs' ratios; ``None`` when any run has none."""
        if not self.runs or any(r.value is None for r in self.runs):
            return None
        return statistics.median(r.value for r in self.runs if r.value is not None)

    @property
    def verdict(self) -> str:
        """``MET`` or ``MISSED`` by the median, ``FAILED`` when a run has no ratio."""
        m = self.median
        if m is None:
            return "FAILED"
        return "MET" if self.target.met(m) else "MISSED"

    @property
    def met_runs(self) -> int:
        """How many runs' own ratio meets the bound."""
        return sum(r.value is not None and self.target.met(r.value) for r in self.runs)

    def line(self) -> str:
        """The printed line: median, every run's value, the bound and the verdict."""
        per_run = ", ".join(
            f"FAILED ({r.failed})"
            if r.value is None
            else f"{r.value:.2f}"
            + (f" ({r.versus})" if self.target.den.system == LMCACHE_BEST else "")
            + (f" ({r.num:.0f} vs {r.den:.0f})" if self.target.compare == "==" else "")
            for r in self.runs
        )
        return (
            f"- {self.workload}: {self.target.name} = {fmt(self.median)} (median of runs: {per_run}; bound "
            f"{self.target.bound_text}): {self.verdict} (met in {self.met_runs} of {len(self.runs)} runs)"
        )

    def as_dict(self) -> dict[str, Any]:
        """The JSON record."""
        return {
            "workload": self.workload,
            "target": self.target.name,
            "metric": self.target.metric,
            "numerator": str(self.target.num),
            "denominator": str(self.target.den),
            "bound": self.target.bound_text,
            "value": self.median,
            "verdict": self.verdict,
            "met_runs": self.met_runs,
            "runs": [
                {
                    "run": r.run,
                    "value": r.value,
                    "versus": r.versus,
                    "failed": r.failed,
                    "num": r.num,
                    "den": r.den,
                }
                for r in self.runs
            ],
        }


def _candidates(phases: list[Phase], wl: str, side: Side, run: int) -> list[Phase]:
    systems = LMCACHE_SYSTEMS if side.system == LMCACHE_BEST else (side.system,)
    return [
        p
        for p in phases
        if p.run == run
        and p.system in systems
        and (p.budget, p.phase) == (side.budget, side.phase)
        and wl in p.results
    ]


def _run_value(phases: list[Phase], wl: str, target: Target, run: int) -> RunValue:
    """The target's ratio within one run, or why it has none."""
    picked: list[Phase] = []
    for side in (target.num, target.den):
        cands = _candidates(phases, wl, side, run)
        if not cands:
            return RunValue(run, None, side.system, f"no {side} phase in run {run + 1}")
        for p in cands:  # LMCache best compares both LMCache systems: a failure in either fails it
            if p.results[wl].failed:
                return RunValue(
                    run,
                    None,
                    p.system,
                    f"{p.results[wl].failed} failed requests in {p.system} {side.budget} {side.phase}",
                )
        picked.append(max(cands, key=lambda p: p.results[wl].summary()["tok_per_s"]))
    num, den = (p.results[wl].summary()[target.metric] for p in picked)
    if num != num or den != den:  # NaN: a counter not read, or no request answered
        return RunValue(run, None, picked[1].system, f"no {target.metric} to divide in run {run + 1}")
    if target.compare == "==":  # equal counts are equal even at 0; anything over 0 is not
        value: float | None = 1.0 if num == den else (num / den if den else math.inf)
    else:
        value = ratio(num, den)
    if value is None:
        return RunValue(run, None, picked[1].system, f"no {target.metric} to divide in run {run + 1}")
    return RunValue(run, value, picked[1].system, num=num, den=den)


def targets(phases: list[Phase]) -> list[TargetResult]:
    """Every target whose two phases ran (in any run), on every workload, ratio within each run."""
    runs = sorted({p.run for p in phases})
    out = []
    for wl in WORKLOADS:
        for t in TARGETS:
            if wl not in t.workloads:
                continue
            if not any(_candidates(phases, wl, t.num, r) and _candidates(phases, wl, t.den, r) for r in runs):
                continue  # not part of this benchmark's selection
            out.append(TargetResult(wl, t, tuple(_run_value(phases, wl, t, r) for r in runs)))
    return out


def format_targets(results: list[TargetResult]) -> str:
    """The ``Targets:`` section the benchmark prints, one line a target."""
    return "\n".join(r.line() for r in results)
