"""``benchmarks/serve.py --quick`` runs end to end: vLLM's load generator against vLLM's OpenAI server
with no connector and with tiercache, a cold and a restart phase.

Three vLLM server starts (~40-55 s each on two cores), ~3 minutes in all. The claims: the benchmark
exits 0 and prints its table; tiercache's restart phase (a fresh vLLM server on the still running
tiercache server) got external hits, and every output of both tiercache phases equals the ``none``
run's (greedy, ``ignore_eos``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
BENCHMARK = ROOT / "benchmarks" / "serve.py"


@pytest.mark.timeout(900)  # three vLLM server starts: more than the suite's 300 s per test on a busy machine
def test_quick_serving_benchmark_hits_tiercache_and_matches_none(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARK), "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr (end):\n{proc.stderr[-6000:]}"
    assert "| workload | system | budget | phase |" in proc.stdout, proc.stdout
    rows: dict[tuple[str, str], dict[str, Any]] = {
        (r["system"], r["phase"]): r for r in json.loads(out.read_text())["rows"]
    }
    assert set(rows) == {("none", "cold"), ("tiercache", "cold"), ("tiercache", "restart")}, sorted(rows)
    restart = rows["tiercache", "restart"]
    assert restart["external_hit_tokens"] > 0, restart
    for phase in ("cold", "restart"):
        equal, total = rows["tiercache", phase]["outputs_equal_none"].split("/")
        assert int(total) > 0 and equal == total, (phase, rows["tiercache", phase]["outputs_equal_none"])
    # Every row's line is in the printed table.
    for system, phase in rows:
        assert f"| prefix | {system} |" in proc.stdout and f"| {phase} |" in proc.stdout
