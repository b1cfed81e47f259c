"""Wait for a condition by polling it, never by sleeping a guessed time: one helper for every test."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T], *, timeout: float = 30.0, interval: float = 0.01, what: str = "the condition"
) -> T:
    """Call ``condition`` until it returns something truthy and return that; raise
    :class:`TimeoutError` naming ``what`` once ``timeout`` seconds have passed.

    The interval doubles from ``interval`` up to 0.25 s, so a slow condition costs few calls and a
    fast one is seen within milliseconds.
    """
    end = time.monotonic() + timeout
    pause = interval
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > end:
            raise TimeoutError(f"{what} did not happen within {timeout:g} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.25)
