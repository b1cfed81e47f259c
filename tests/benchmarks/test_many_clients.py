"""Specification: ``benchmarks/many_clients.py`` measures a round trip to the server beside the same
round trip to a bare pyzmq ROUTER (the transport's floor), and refuses an operation it does not know."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "benchmarks/many_clients.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_ping_and_the_bare_zmq_floor_are_rows_of_the_table() -> None:
    done = run("--ops", "ping,zmq", "--clients", "1", "--idle", "0", "--seconds", "0.5")
    assert done.returncode == 0, done.stderr
    rows = {
        line.split("|")[1].strip(): line.split("|")
        for line in done.stdout.splitlines()
        if line.startswith("| ")
    }
    for op in ("ping", "zmq"):
        cells = [cell.strip() for cell in rows[op]]
        assert int(cells[3].replace(",", "")) > 0  # round trips a second
        assert float(cells[6]) > 0 and cells[7] == "–"  # server CPU per op; no chunks


def test_an_unknown_operation_is_refused_naming_the_known_ones() -> None:
    refused = run("--ops", "lookup,nope")
    assert refused.returncode == 2
    assert "unknown operation(s) nope" in refused.stderr and "ping, zmq" in refused.stderr
