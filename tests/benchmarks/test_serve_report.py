"""The serving benchmark's table and targets (``benchmarks/serve_report.py``) on made-up phases.

No vLLM and no server: each test builds the :class:`Phase` records ``benchmarks/serve.py`` would
collect from its runs, with figures chosen so that a ratio of medians and a median of within-run
ratios differ, and checks what the report computes from them. ``benchmarks/serve.py --quick`` (real
servers) is a command in docs/benchmarks.md; what it exercises end to end is
tests/e2e/test_openai_server.py's.
"""

from __future__ import annotations

import statistics

import pytest

from benchmarks.serve_report import (
    LMCACHE_BEST,
    LOOKUP_SECONDS_COUNT,
    LOOKUP_SECONDS_SUM,
    LOOKUPS_DEFERRED,
    PREEMPTIONS,
    PROMPT_COMPUTED,
    TARGETS,
    Phase,
    TargetResult,
    WorkloadResult,
    format_targets,
    rows_of,
    table,
    targets,
)

DURATION_S = 10.0


def result(
    tok_per_s: float, ttft_ms: float = 100.0, failed: int = 0, text: str = "a b", computed: float = 1536.0
) -> WorkloadResult:
    """A prefix workload whose tok/s is ``tok_per_s``, whose every TTFT (so p50 and mean) is
    ``ttft_ms`` and in which vLLM computed ``computed`` prompt tokens."""
    return WorkloadResult(
        workload="prefix",
        duration_s=DURATION_S,
        requests=4,
        failed=failed,
        total_tokens=round(tok_per_s * DURATION_S),
        ttfts=[ttft_ms / 1e3] * 4,
        texts=[text] * 4,
        counters={PROMPT_COMPUTED: computed},
        external_hits=128.0,
    )


def phase(system: str, budget: str, name: str, run: int, r: WorkloadResult) -> Phase:
    return Phase(system, budget, name, run, 1.0, {"prefix": r})


#: Per run: (floor pass 2, floor tiercache restart, tiercache third restart, tiercache full restart,
#: lmcache third restart, lmcache-fs third restart), tok/s. Chosen so that the median of the within-run
#: ratios (floor: 1.10, 0.90, 0.93 -> 0.93, missed) is not the ratio of the medians (1100 / 1100, met).
#: The floor-sized restart computes as many prompt tokens as pass 2 in runs 1 and 3, 3072 in run 2.
TOK_PER_S = (
    (1000.0, 1100.0, 1200.0, 1000.0, 1000.0, 900.0),
    (1100.0, 990.0, 1000.0, 1000.0, 800.0, 1000.0),
    (1200.0, 1116.0, 1100.0, 1000.0, 1000.0, 1000.0),
)


def all_phases(failed_run: int | None = None) -> list[Phase]:
    """Three runs of everything the targets read; ``failed_run``: tiercache third restart fails a request there."""
    out = []
    for run, (p2, tcf, third, full, lmc, lmc_fs) in enumerate(TOK_PER_S):
        out += [
            phase("none", "–", "cold", run, result(400.0)),
            phase("floor", "–", "pass 2", run, result(p2, ttft_ms=100.0)),
            phase(
                "floor",
                "full",
                "tiercache restart",
                run,
                result(tcf, ttft_ms=100.0 + 5 * run, computed=3072.0 if run == 1 else 1536.0),
            ),
            phase("tiercache", "third", "cold", run, result(1000.0)),
            phase(
                "tiercache",
                "third",
                "restart",
                run,
                result(third, ttft_ms=80.0, failed=int(run == failed_run)),
            ),
            phase("tiercache", "full", "restart", run, result(full)),
            phase("lmcache", "third", "cold", run, result(1000.0)),
            phase("lmcache-fs", "third", "cold", run, result(1000.0)),
            phase("lmcache", "third", "restart", run, result(lmc, ttft_ms=100.0)),
            phase("lmcache-fs", "third", "restart", run, result(lmc_fs, ttft_ms=120.0)),
        ]
    return out


def by_name(results: list[TargetResult]) -> dict[str, TargetResult]:
    assert {r.workload for r in results} == {"prefix"}
    return {r.target.name: r for r in results}


def test_the_bounds_are_the_documented_ones() -> None:
    """The one table of bounds (docs/benchmarks.md prints it): names, what is divided, the bounds."""
    assert [(t.name, t.metric, str(t.num), str(t.den), t.bound_text) for t in TARGETS] == [
        (
            "floor-sized restart: prompt tokens computed vs pass 2",
            "prompt_tokens_computed",
            "floor full tiercache restart",
            "floor – pass 2",
            "= 1.00",
        ),
        (
            "floor-sized restart: mean TTFT ÷ pass 2",
            "ttft_mean_ms",
            "floor full tiercache restart",
            "floor – pass 2",
            "≤ 1.00",
        ),
        (
            "floor-sized restart: tok/s ÷ pass 2",
            "tok_per_s",
            "floor full tiercache restart",
            "floor – pass 2",
            "≥ 0.95",
        ),
        (
            "third: restart tok/s ÷ LMCache best",
            "tok_per_s",
            "tiercache third restart",
            "lmcache best third restart",
            "≥ 1.15",
        ),
        (
            "third: restart TTFT p50 ÷ LMCache best",
            "ttft_p50_ms",
            "tiercache third restart",
            "lmcache best third restart",
            "≤ 0.80",
        ),
        (
            "third: restart TTFT p99 ÷ LMCache best",
            "ttft_p99_ms",
            "tiercache third restart",
            "lmcache best third restart",
            "≤ 1.00",
        ),
        (
            "third: cold tok/s ÷ LMCache best",
            "tok_per_s",
            "tiercache third cold",
            "lmcache best third cold",
            "≥ 0.95",
        ),
        ("cold tok/s ÷ none", "tok_per_s", "tiercache full cold", "none – cold", "≥ 0.99"),
        ("cold mean TTFT ÷ none", "ttft_mean_ms", "tiercache full cold", "none – cold", "≤ 1.02"),
    ]
    assert {t.name: t.workloads for t in TARGETS if "miss" in t.workloads} == {
        "cold tok/s ÷ none": ("miss",),
        "cold mean TTFT ÷ none": ("miss",),
    }


def test_the_cache_servers_cpu_is_divided_by_requests_and_by_promoted_chunks() -> None:
    """The restart's cost on the node: the cache server's CPU over the workload per request served and
    per chunk it promoted from disk; NaN (a dash in the table) where it was not read or nothing was
    promoted, never a division by zero."""
    r = result(1000.0)
    r.cache = {"cpu_s": 0.6, "promotions": 300.0}
    s = r.summary()
    assert s["cache_cpu_ms_per_request"] == pytest.approx(150.0)  # 600 ms over 4 requests
    assert s["cache_cpu_ms_per_promotion"] == pytest.approx(2.0)
    r.cache = {"cpu_s": 0.6, "promotions": 0.0}
    assert r.summary()["cache_cpu_ms_per_promotion"] != r.summary()["cache_cpu_ms_per_promotion"]
    unread = result(1000.0).summary()
    assert unread["cache_cpu_ms_per_request"] != unread["cache_cpu_ms_per_request"]
    text, _ = table(rows_of([phase("tiercache", "third", "restart", 0, r)]))
    assert "| 150.0 | – |" in text


def test_the_engines_preemptions_are_a_column_and_a_dash_when_not_read() -> None:
    """vLLM's preemptions over the workload (requests whose KV it freed for want of blocks) stand
    beside the prompt tokens it computed; a counter the engine did not export is a dash, not 0."""
    r = result(1000.0, computed=1536.0)
    r.counters[PREEMPTIONS] = 3.0
    assert r.summary()["preemptions"] == 3.0
    text, rows = table(rows_of([phase("tiercache", "third", "restart", 0, r)]))
    assert "| computed prompt tokens | preemptions |" in text
    assert "| 1536 | 3 |" in text
    assert rows[0]["preemptions"] == 3.0
    unread, _ = table(rows_of([phase("tiercache", "third", "restart", 0, result(1000.0, computed=1536.0))]))
    assert "| 1536 | – |" in unread


def test_the_connectors_deferred_lookups_and_mean_lookup_wait_are_columns() -> None:
    """How many requests vLLM held back a step for their lookup, and the lookups' mean wait, from
    tiercache's connector metrics; a system that exports none of them shows dashes."""
    r = result(1000.0, computed=1536.0)
    r.counters[PREEMPTIONS] = 0.0
    r.counters.update({LOOKUPS_DEFERRED: 12.0, LOOKUP_SECONDS_SUM: 0.9, LOOKUP_SECONDS_COUNT: 20.0})
    assert r.summary()["lookup_wait_mean_ms"] == pytest.approx(45.0)
    text, rows = table(rows_of([phase("tiercache", "third", "restart", 0, r)]))
    assert "| preemptions | lookups deferred | lookup wait mean ms |" in text
    assert "| 1536 | 0 | 12 | 45.0 |" in text
    assert rows[0]["lookups_deferred"] == 12.0
    unread, _ = table(rows_of([phase("lmcache-fs", "third", "restart", 0, result(1000.0, computed=1536.0))]))
    assert "| 1536 | – | – | – |" in unread


def test_the_targets_are_checked_on_both_workloads() -> None:
    chat = [
        Phase(p.system, p.budget, p.phase, p.run, p.start_s, {**p.results, "chat": p.results["prefix"]})
        for p in all_phases()
    ]
    got = targets(chat)
    assert [(r.workload, r.target.name) for r in got] == [
        (wl, t.name) for wl in ("prefix", "chat") for t in TARGETS if wl in t.workloads
    ]


def test_a_miss_costs_what_tiercache_cold_takes_over_none_on_unique_prompts_only() -> None:
    """The miss targets read only the miss workload: tiercache's cold phase against no connector."""
    phases = []
    for run, (tc, none_tok, tc_ttft) in enumerate(
        ((990.0, 1000.0, 103.0), (1000.0, 1000.0, 101.0), (995.0, 1000.0, 102.0))
    ):
        for system, budget, tok, ttft in (("none", "–", none_tok, 100.0), ("tiercache", "full", tc, tc_ttft)):
            r = result(tok, ttft_ms=ttft)
            phases.append(
                Phase(
                    system,
                    budget,
                    "cold",
                    run,
                    1.0,
                    {"miss": WorkloadResult(**{**r.__dict__, "workload": "miss"})},
                )
            )
    got = {(r.workload, r.target.name): r for r in targets(phases)}
    assert set(got) == {("miss", "cold tok/s ÷ none"), ("miss", "cold mean TTFT ÷ none")}
    tok = got[("miss", "cold tok/s ÷ none")]
    assert [r.value for r in tok.runs] == pytest.approx([0.99, 1.00, 0.995]) and tok.verdict == "MET"
    ttft = got[("miss", "cold mean TTFT ÷ none")]
    assert [r.value for r in ttft.runs] == pytest.approx([1.03, 1.01, 1.02]) and ttft.verdict == "MET"
    assert ttft.met_runs == 2  # 1.03 misses in its run; the median (1.02) is at the bound


def test_each_target_is_the_median_of_its_within_run_ratios() -> None:
    got = by_name(targets(all_phases()))
    assert set(got) == {t.name for t in TARGETS if "prefix" in t.workloads}
    floor = got["floor-sized restart: tok/s ÷ pass 2"]
    assert [r.value for r in floor.runs] == pytest.approx([1.1, 0.9, 0.93])
    assert floor.median == pytest.approx(0.93)
    medians_ratio = statistics.median(t[1] for t in TOK_PER_S) / statistics.median(t[0] for t in TOK_PER_S)
    assert medians_ratio == pytest.approx(1.0)  # a ratio of medians would have said met
    assert floor.verdict == "MISSED" and floor.met_runs == 1

    ttft = got["floor-sized restart: mean TTFT ÷ pass 2"]
    assert [r.value for r in ttft.runs] == pytest.approx([1.00, 1.05, 1.10])
    assert ttft.verdict == "MISSED" and ttft.met_runs == 1  # exactly at the bound is met


def test_prompt_tokens_computed_must_equal_pass_2s_in_each_run() -> None:
    got = by_name(targets(all_phases()))["floor-sized restart: prompt tokens computed vs pass 2"]
    assert [(r.num, r.den) for r in got.runs] == [(1536, 1536), (3072, 1536), (1536, 1536)]
    assert [r.value for r in got.runs] == [1.0, 2.0, 1.0]
    assert got.met_runs == 2 and got.verdict == "MET"  # by the median, as every target
    assert (
        "= 1.00 (median of runs: 1.00 (1536 vs 1536), 2.00 (3072 vs 1536), 1.00 (1536 vs 1536); bound = 1.00)"
        in (got.line())
    )
    t = got.target
    assert not t.met(1.0001) and not t.met(0.9999) and t.met(1.0)  # equal means equal

    # 0 computed on both sides is equal; any computed against 0 is not (and is no failure).
    zero = [
        phase("floor", "–", "pass 2", 0, result(1000.0, computed=0.0)),
        phase("floor", "full", "tiercache restart", 0, result(1000.0, computed=0.0)),
        phase("floor", "–", "pass 2", 1, result(1000.0, computed=0.0)),
        phase("floor", "full", "tiercache restart", 1, result(1000.0, computed=32.0)),
    ]
    eq = by_name([r for r in targets(zero) if r.target is t])[t.name]
    assert [r.value for r in eq.runs] == [1.0, float("inf")] and eq.runs[1].failed is None


def test_a_counter_not_read_fails_the_equality_target() -> None:
    phases = [
        Phase(
            p.system, p.budget, p.phase, p.run, p.start_s, {"prefix": result(1000.0, computed=float("nan"))}
        )
        if (p.system, p.phase, p.run) == ("floor", "pass 2", 0)
        else p
        for p in all_phases()
    ]
    got = by_name(targets(phases))["floor-sized restart: prompt tokens computed vs pass 2"]
    assert got.verdict == "FAILED" and got.runs[0].failed == "no prompt_tokens_computed to divide in run 1"


def test_lmcache_best_is_chosen_within_each_run() -> None:
    got = by_name(targets(all_phases()))
    restart = got["third: restart tok/s ÷ LMCache best"]
    assert [r.versus for r in restart.runs] == ["lmcache", "lmcache-fs", "lmcache"]
    assert [r.value for r in restart.runs] == pytest.approx([1.2, 1.0, 1.1])
    assert restart.median == pytest.approx(1.1)
    assert restart.verdict == "MISSED" and restart.met_runs == 1
    # The p50 target divides by the same (fastest) LMCache system's p50: 80 / 100 or 80 / 120.
    p50 = got["third: restart TTFT p50 ÷ LMCache best"]
    assert [r.value for r in p50.runs] == pytest.approx([0.8, 80 / 120, 0.8])
    assert p50.verdict == "MET" and p50.met_runs == 3
    assert restart.target.den.system == LMCACHE_BEST


def test_the_printed_line_carries_every_run_and_the_verdict() -> None:
    got = by_name(targets(all_phases()))
    line = got["third: restart tok/s ÷ LMCache best"].line()
    assert line == (
        "- prefix: third: restart tok/s ÷ LMCache best = 1.10 (median of runs: 1.20 (lmcache), 1.00 "
        "(lmcache-fs), 1.10 (lmcache); bound ≥ 1.15): MISSED (met in 1 of 3 runs)"
    )
    text = format_targets(targets(all_phases()))
    assert text.count("\n") == sum("prefix" in t.workloads for t in TARGETS) - 1
    assert "= 0.93 (median of runs: 1.10, 0.90, 0.93; bound ≥ 0.95): MISSED (met in 1 of 3 runs)" in text


def test_a_failed_request_fails_its_row_and_every_target_that_reads_it() -> None:
    phases = all_phases(failed_run=1)
    rows = {(r.system, r.budget, r.phase): r for r in rows_of(phases)}
    assert rows["tiercache", "third", "restart"].failed == 1
    assert all(r.failed == 0 for key, r in rows.items() if key != ("tiercache", "third", "restart"))
    text, out = table(list(rows.values()))
    [line] = [ln for ln in text.splitlines() if "| prefix | tiercache | third | restart |" in ln]
    assert line.endswith("| 1 FAILED |")
    assert {(d["system"], d["phase"], d["failed_requests"]) for d in out if d["failed_requests"]} == {
        ("tiercache", "restart", 1)
    }

    got = by_name(targets(phases))
    reads_it = {
        t.name
        for t in TARGETS
        if ("tiercache", "third", "restart") in {(s.system, s.budget, s.phase) for s in (t.num, t.den)}
    }
    assert reads_it == {
        "third: restart tok/s ÷ LMCache best",
        "third: restart TTFT p50 ÷ LMCache best",
        "third: restart TTFT p99 ÷ LMCache best",
    }
    for name, r in got.items():
        if name in reads_it:
            assert r.verdict == "FAILED" and r.median is None, name
            assert r.runs[1].value is None and "1 failed requests in tiercache third restart" in (
                r.runs[1].failed or ""
            )
            line = r.line()
            assert "FAILED (1 failed requests in tiercache third restart)" in line, line
            assert "): FAILED (met in " in line, line
        else:
            assert r.verdict in ("MET", "MISSED"), name


def test_a_failed_request_on_either_lmcache_system_fails_the_lmcache_best_targets() -> None:
    phases = [
        Phase(p.system, p.budget, p.phase, p.run, p.start_s, {"prefix": result(1.0, failed=1)})
        if (p.system, p.phase, p.run) == ("lmcache-fs", "cold", 0)  # the slower one in every run
        else p
        for p in all_phases()
    ]
    got = by_name(targets(phases))
    assert got["third: cold tok/s ÷ LMCache best"].verdict == "FAILED"
    assert got["third: restart tok/s ÷ LMCache best"].verdict == "MISSED"


def test_a_phase_missing_from_one_run_fails_its_targets() -> None:
    phases = [p for p in all_phases() if (p.system, p.phase, p.run) != ("floor", "pass 2", 2)]
    got = by_name(targets(phases))
    for name in (t.name for t in TARGETS if t.den.phase == "pass 2"):
        r = got[name]
        assert r.verdict == "FAILED" and r.runs[2].failed == "no floor – pass 2 phase in run 3", name
    r = got["floor-sized restart: tok/s ÷ pass 2"]
    assert [x.value for x in r.runs[:2]] == pytest.approx([1.1, 0.9])


def test_targets_whose_phases_did_not_run_are_left_out() -> None:
    quick = [  # what --quick runs: none and tiercache, the full budget, no floor
        phase("none", "–", "cold", 0, result(400.0)),
        phase("tiercache", "full", "cold", 0, result(500.0)),
        phase("tiercache", "full", "restart", 0, result(900.0)),
    ]
    assert targets(quick) == []
    text, out = table(rows_of(quick))
    assert [(d["system"], d["phase"], d["outputs_equal_none"]) for d in out] == [
        ("none", "cold", "4/4"),
        ("tiercache", "cold", "4/4"),
        ("tiercache", "restart", "4/4"),
    ]
    assert [d["tok_per_s_vs_none"] for d in out] == pytest.approx([1.0, 1.25, 2.25])
    assert len(text.splitlines()) == 2 + len(out)


def test_outputs_are_compared_with_none_request_by_request_within_each_run() -> None:
    phases = [
        phase("none", "–", "cold", 0, result(400.0, text="x")),
        phase("none", "–", "cold", 1, result(400.0, text="y")),
        phase("tiercache", "full", "restart", 0, result(900.0, text="x")),
        phase("tiercache", "full", "restart", 1, result(900.0, text="x")),  # run 2's none said "y"
    ]
    rows = {(r.system, r.phase): r for r in rows_of(phases)}
    assert rows["tiercache", "restart"].same_as_none == "4/8"
    assert rows["tiercache", "restart"].ext_hits == 128.0
