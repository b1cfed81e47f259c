"""Specification: ``python -m benchmarks`` lists every benchmark with what it measures and runs one
by name, as its own script would run; an unknown name is refused naming the known ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_the_list_names_every_benchmark_and_none_of_the_serving_benchmarks_parts() -> None:
    listed = run()
    assert listed.returncode == 0, listed.stderr
    names = {line.split()[0] for line in listed.stdout.splitlines()[2:] if line.strip()}
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_")}
    assert names == scripts - {"common", "serve_figure", "serve_plan", "serve_report"}
    assert "s3_index Benchmark the S3 tier's capacity index" in " ".join(listed.stdout.split())


def test_a_benchmark_runs_by_name_with_its_arguments() -> None:
    done = run("hashing", "--help")
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def test_an_unknown_name_is_refused_naming_the_known_ones() -> None:
    refused = run("nope")
    assert refused.returncode == 2
    assert "no benchmark 'nope'" in refused.stderr and "many_clients" in refused.stderr
