"""A small circuit breaker: stop calling an unhealthy S3 endpoint for a while, then try once.

States::

    CLOSED ──(``failures`` consecutive failures)──► OPEN ──(``cooldown_s`` elapsed)──► HALF_OPEN
      ▲                                               ▲                                   │
      └───────────────(the one trial succeeds)────────┴─────(the one trial fails)──────────┘

While OPEN every call is refused instantly (the tier counts it as ``skipped``), so an S3 outage costs
the engine a few timed-out requests and then nothing at all until the cool-down ends. In HALF_OPEN
exactly one caller is let through as a trial; everyone else is still refused until it reports back.

Thread-safe; every method is a few dictionary-free operations under one lock and never blocks on I/O.
Time comes from the injected ``clock`` so tests drive the cool-down without sleeping.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable


class BreakerState(enum.StrEnum):
    """Where the breaker stands."""

    CLOSED = "closed"  # healthy: every call goes through
    OPEN = "open"  # unhealthy: calls are refused until the cool-down ends
    HALF_OPEN = "half_open"  # cool-down over: one trial call decides


class CircuitBreaker:
    """Counts consecutive failures and refuses calls while the endpoint is considered down.

    Usage: ``if breaker.allow(): try call; breaker.record_success() / record_failure()``. Every
    allowed call must report exactly one outcome, or a half-open trial would block the breaker.
    """

    def __init__(
        self, failures: int, cooldown_s: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if failures < 1:
            raise ValueError(f"breaker failures must be >= 1, got {failures}")
        self._threshold = failures
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        # guarded by _lock:
        self._state = BreakerState.CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._trial_in_flight = False

    @property
    def state(self) -> BreakerState:
        """The current state (an OPEN breaker whose cool-down has ended reads as HALF_OPEN)."""
        with self._lock:
            self._maybe_half_open()
            return self._state

    def allow(self) -> bool:
        """Whether a call may be attempted now. Never blocks; O(1)."""
        with self._lock:
            self._maybe_half_open()
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.HALF_OPEN and not self._trial_in_flight:
                self._trial_in_flight = True
                return True
            return False

    def record_success(self) -> None:
        """The endpoint answered: close the breaker and forget earlier failures."""
        with self._lock:
            self._state = BreakerState.CLOSED
            self._consecutive = 0
            self._trial_in_flight = False

    def record_failure(self) -> None:
        """The endpoint failed (after the client's own retries); may open the breaker."""
        with self._lock:
            self._consecutive += 1
            was_trial = self._state is BreakerState.HALF_OPEN
            self._trial_in_flight = False
            if was_trial or self._consecutive >= self._threshold:
                self._state = BreakerState.OPEN
                self._opened_at = self._clock()

    def _maybe_half_open(self) -> None:
        # caller holds _lock
        if self._state is BreakerState.OPEN and self._clock() >= self._opened_at + self._cooldown_s:
            self._state = BreakerState.HALF_OPEN
            self._trial_in_flight = False
