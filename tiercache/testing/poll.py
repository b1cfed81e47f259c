"""Wait for a condition by polling it, never by sleeping a guessed time: one helper for every test."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], *, timeout: float = 30.0, interval: float = 0.02, what: str) -> T:
    """Call ``condition`` every ``interval`` seconds until it returns something truthy, and return
    that; raise :class:`TimeoutError` naming ``what`` once ``timeout`` seconds have passed."""
    end = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def stop_process(pid: int, *, timeout: float = 10.0) -> None:
    """Stop process ``pid`` (SIGSTOP) and return once it is stopped: the signal is delivered when
    the kernel gets to it, and a process still running on another core would answer meanwhile."""
    import os
    import signal
    from pathlib import Path

    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] in "Tt"  # the state field, after the command's parentheses

    wait_until(stopped, timeout=timeout, interval=0.001, what=f"process {pid} to stop")
