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
