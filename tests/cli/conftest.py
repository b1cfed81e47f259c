"""Fixtures for CLI tests: a clean, per-test environment so no TIERCACHE_* or XDG setting leaks in."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No TIERCACHE_* variables; per-user data and runtime dirs inside the test's temp dir."""
    for name in list(os.environ):
        if name.startswith("TIERCACHE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    return tmp_path


def one_line(text: str) -> str:
    """The single line of ``text``; fails the test if there are more (errors must be one line)."""
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected exactly one line, got {len(lines)}:\n{text}"
    return lines[0]
