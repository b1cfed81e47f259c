"""Wait for a condition by polling it, never by sleeping a guessed time: one helper for every test."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

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


def _code(function: Callable[..., Any]) -> object:
    """The code object ``function`` runs (a bound method's function's)."""
    return getattr(function, "__func__", function).__code__


def blocked_in(
    thread: threading.Thread, call: Callable[..., Any], *, on: Callable[..., Any] = threading.Condition.wait
) -> bool:
    """Whether ``thread`` is blocked in ``call``: its innermost Python frame runs ``on`` (by default
    :meth:`threading.Condition.wait`, where ``Event.wait``, ``Condition.wait_for`` and
    ``queue.Queue.get`` block too) and ``call`` is on its stack below that frame.

    A thread inside ``Condition.wait`` has found its predicate false under the condition's lock, so
    a notify made after this returns ``True`` reaches it: the call really waited for it. Reads
    :func:`sys._current_frames`, CPython's view of every thread's stack."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None or frame.f_code is not _code(on):
        return False
    target = _code(call)
    while frame is not None:
        if frame.f_code is target:
            return True
        frame = frame.f_back
    return False


def wait_blocked(
    thread: threading.Thread,
    call: Callable[..., Any],
    *,
    on: Callable[..., Any] = threading.Condition.wait,
    timeout: float = 10.0,
    what: str,
) -> None:
    """Return once ``thread`` is blocked in ``call`` (:func:`blocked_in`), so that a test releases
    the call only after it has observed that it waits, instead of a timer that may fire first.
    Raise :class:`AssertionError` if ``thread`` ends first (the call returned without blocking),
    :class:`TimeoutError` naming ``what`` after ``timeout`` seconds."""

    def blocked() -> bool:
        if blocked_in(thread, call, on=on):
            return True
        if not thread.is_alive():
            raise AssertionError(f"{what}: thread {thread.name!r} ended without blocking")
        return False

    wait_until(blocked, timeout=timeout, interval=0.001, what=what)


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
