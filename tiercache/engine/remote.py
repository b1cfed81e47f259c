"""Remote tiers' part of a lookup: on workers of their own, within a time budget.

A lookup runs on the server's I/O workers, which also answer every L1 and disk hit. A remote tier
(S3) that answers late must not hold them: every remote question of a lookup runs on
:class:`RemoteAsker`'s own bounded pool and the lookup waits for it at most its budget
(``--remote-lookup-budget-s``), counted from the lookup's first remote question. Past the budget, or
when the pool is already full, the remote tier counts as holding nothing for that lookup (a shorter
prefix, never a wrong one: :mod:`tiercache.engine.lookup`); the question still runs to its end on
the pool, so its answer is remembered by the tier's existence cache for the next lookup.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from tiercache.engine.counters import EngineCounters

T = TypeVar("T")

#: Questions queued per remote worker before a lookup stops asking (bounds the pool's queue).
_QUEUED_PER_WORKER = 2


class RemoteAsker:
    """Runs remote tiers' lookup questions on ``workers`` threads of their own (module docstring).
    Thread-safe."""

    def __init__(self, workers: int, budget_s: float, counters: EngineCounters) -> None:
        self.budget_s = budget_s
        self._counters = counters
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tiercache-remote-lookup")
        self._bound = workers * _QUEUED_PER_WORKER
        self._lock = threading.Lock()
        self._inflight = 0  # guarded by _lock

    def session(self) -> RemoteBudget:
        """The budget of one lookup: every remote question it asks shares it."""
        return RemoteBudget(self)

    def _submit(self, fn: Callable[[], T]) -> Future[T] | None:
        with self._lock:
            if self._inflight >= self._bound:
                return None
            self._inflight += 1
        try:
            future = self._pool.submit(fn)
        except RuntimeError:  # shut down: the engine is closing
            self._done(None)
            return None
        future.add_done_callback(self._done)
        return future

    def _done(self, _: object) -> None:
        with self._lock:
            self._inflight -= 1

    def close(self) -> None:
        """Stop the pool; questions still running end on their own (their tier's timeouts)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class RemoteBudget:
    """One lookup's remote questions (:meth:`RemoteAsker.session`). Not thread-safe: one lookup."""

    __slots__ = ("_asker", "_deadline", "_spent")

    def __init__(self, asker: RemoteAsker) -> None:
        self._asker = asker
        self._deadline: float | None = None
        self._spent = False

    def ask(self, fn: Callable[[], T], absent: T) -> T:
        """``fn()``'s answer, run on the remote pool; ``absent`` once the lookup's budget is spent,
        when the pool is full, or when ``fn`` raises (a remote tier's lookup methods never should)."""
        if self._spent:
            return absent
        counters = self._asker._counters
        future = self._asker._submit(fn)
        if future is None:
            counters.add("remote_lookups_busy")
            self._spent = True  # the pool is full: the rest of this lookup would be too
            return absent
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + self._asker.budget_s
        try:
            return future.result(timeout=max(0.0, self._deadline - now))
        except FutureTimeout:
            counters.add("remote_lookups_late")
            self._spent = True
            return absent
        except Exception:  # a lookup must answer; the tier counted its own failure
            return absent
