"""`tiercache bench` shows its progress on stderr, one step per tier × chunk size, never on stdout."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from tiercache.cli import measure as bench
from tiercache.cli.app import main
from tiercache.cli.bench import BenchProgress

KiB = 1 << 10


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_each_tier_reports_every_size_case_in_order(tmp_path: Path) -> None:
    calls: list[tuple[str, int, str]] = []
    bench.bench_l1([256 * KiB, 512 * KiB], 1 << 20, 1, progress=lambda *a: calls.append(a))
    bench.bench_disk([256 * KiB], 1 << 20, 1, tmp_path, progress=lambda *a: calls.append(a))
    assert calls == [
        ("l1", 256 * KiB, "start"),
        ("l1", 256 * KiB, "done"),
        ("l1", 512 * KiB, "start"),
        ("l1", 512 * KiB, "done"),
        ("disk", 256 * KiB, "start"),
        ("disk", 256 * KiB, "done"),
    ]


def test_without_a_terminal_progress_is_plain_lines_on_stderr(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main(
        [
            "bench",
            "--tiers",
            "l1,disk",
            "--sizes",
            "256k,512k",
            "--total-mb",
            "1",
            "--rounds",
            "1",
            "--disk-path",
            str(tmp_path),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0
    lines = err.splitlines()
    for i, case in enumerate(["l1 256 KiB", "l1 512 KiB", "disk 256 KiB", "disk 512 KiB"], start=1):
        assert f"[{i}/4] {case} …" in lines
        assert any(line.startswith(f"[{i}/4] {case} done in ") for line in lines)
    assert "\x1b" not in err  # no escape codes in a log file
    assert "[1/4]" not in out and "disk" in out  # stdout carries only the table


def test_on_a_terminal_progress_is_a_rich_bar() -> None:
    stream = _Tty()
    with BenchProgress(2, stream=stream) as progress:
        assert progress.tty
        progress.note("measuring L1 …")
        for size in (256 * KiB, 1 << 20):
            progress("l1", size, "start")
            progress("l1", size, "done")
    text = stream.getvalue()
    assert "\x1b[" in text  # drawn with terminal control codes
    assert "2/2" in text and "measuring L1" in text
    assert "[1/2]" not in text  # not the plain-line format
