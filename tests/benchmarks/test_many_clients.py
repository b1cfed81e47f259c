"""Specification: ``benchmarks/many_clients.py`` measures a round trip to the server beside the same
round trip to a bare pyzmq ROUTER (the transport's floor) and over a bare Unix socket, runs the server at
another nice value when asked, refuses an operation it does not know, and compares this tree's server with another tree's, alternately, round by round."""

from __future__ import annotations

import os
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


def test_a_ping_and_the_bare_zmq_and_unix_socket_floors_are_rows_of_the_table() -> None:
    done = run("--ops", "ping,zmq,uds", "--clients", "1", "--idle", "0", "--seconds", "0.5")
    assert done.returncode == 0, done.stderr
    rows = {
        line.split("|")[1].strip(): line.split("|")
        for line in done.stdout.splitlines()
        if line.startswith("| ")
    }
    for op in ("ping", "zmq", "uds"):
        cells = [cell.strip() for cell in rows[op]]
        assert int(cells[3].replace(",", "")) > 0  # round trips a second
        assert float(cells[6]) > 0 and cells[7] == "–"  # server CPU per op; no chunks


def test_the_table_runs_over_a_unix_endpoint_too_with_each_clients_p99() -> None:
    done = run(
        "--ops", "lookup,ping", "--clients", "2", "--idle", "2", "--seconds", "0.5", "--transport", "unix"
    )
    assert done.returncode == 0, done.stderr
    rows = [
        line.split("|") for line in done.stdout.splitlines() if line.startswith(("| lookup |", "| ping |"))
    ]
    assert [cells[1].strip() for cells in rows] == ["lookup", "ping"]
    assert all(int(cells[3].replace(",", "")) > 0 for cells in rows)
    for cells in rows:  # the two clients' p99s, taken one by one, lie either side of both's
        low, high = map(float, cells[9].split("–"))
        assert low <= float(cells[5]) <= high


def test_server_nice_is_added_to_the_server_process_nice_value_and_the_table_says_what_it_has() -> None:
    done = run("--ops", "ping", "--clients", "1", "--idle", "0", "--seconds", "0.3", "--server-nice", "3")
    assert done.returncode == 0, done.stderr
    assert f"server at nice {min(19, os.getpriority(os.PRIO_PROCESS, 0) + 3)}\n" in done.stdout
    assert any(line.startswith("| ping | 1 |") for line in done.stdout.splitlines())


def test_an_unknown_operation_is_refused_naming_the_known_ones() -> None:
    refused = run("--ops", "lookup,nope")
    assert refused.returncode == 2
    assert "unknown operation(s) nope" in refused.stderr and "ping, zmq, uds" in refused.stderr


def test_against_another_tree_alternates_the_order_and_prints_each_rounds_ratios_and_their_medians() -> None:
    """Of the server's CPU and of the p99, both trees on the transport asked for (the other tree's
    script takes ``--transport``: it is this one)."""
    done = run(
        *("--against", str(ROOT), "--rounds", "2", "--transport", "unix"),
        *("--ops", "ping", "--clients", "1", "--idle", "0", "--seconds", "0.3"),
    )
    assert done.returncode == 0, done.stderr
    assert f"that: {ROOT} --transport unix --server-nice 0" in done.stdout
    order = [line.split(":")[0] for line in done.stdout.splitlines() if line.startswith("round ")]
    assert order == ["round 1, this", "round 1, that", "round 2, that", "round 2, this"]
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| ping | 1 |")]
    assert len(rows) == 2  # server CPU, then p99
    for row in rows:
        ratios = [float(r) for r in row[3].split(",")]
        assert len(ratios) == 2 and all(r > 0 for r in ratios)
        assert abs(float(row[4]) - sum(ratios) / 2) <= 0.006  # their median (each printed to 0.01)


def test_against_a_directory_without_the_benchmark_is_refused(tmp_path: Path) -> None:
    refused = run("--against", str(tmp_path))
    assert refused.returncode == 2
    assert "give a tiercache source tree" in refused.stderr
