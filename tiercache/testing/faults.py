"""Fault injection for tests: a tier wrapper that breaks the tier it wraps on purpose.

:class:`FaultInjectingTier` is how tests (and, for testing only, a server started by the tests with
fault injection) make a tier fail: errors, latency, a gate that holds writes, "disk full". Nothing in
the product enables it.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tiercache.errors import TierError, TierFullError
from tiercache.keys.object_key import ObjectKey
from tiercache.keys.tenant import DEFAULT_TENANT
from tiercache.tier.contract import HeldSet, ReadHandle, Tier, WriteHandle
from tiercache.tier.wrappers import WrapperTier


@dataclass
class FaultPlan:
    """What a :class:`FaultInjectingTier` does to the calls it forwards. Change it at any time.

    ``write_gate`` (when set) holds every write until the event is set — a stalled disk.
    ``fail_writes`` / ``fail_reads`` make calls raise :class:`TierError` (reads then miss).
    ``full`` makes reservations raise :class:`TierFullError`. ``latency_s`` delays every call.
    ``error_rate`` (0..1) fails that fraction of reads and writes at random (a flaky device; ``seed``
    makes the sequence repeatable). ``injected`` counts every fault injected.

    Bit flips and truncations are *not* injected here on purpose: a wrapper sits above the tier's
    verification, so bytes it damaged would bypass the very check under test. The reliability tests
    damage the bytes at rest instead (the LMDB file, the S3 objects), below the frame check.
    """

    fail_writes: bool = False
    fail_reads: bool = False
    full: bool = False
    latency_s: float = 0.0
    write_gate: threading.Event | None = None
    error_rate: float = 0.0
    seed: int | None = None
    injected: int = field(default=0)
    _rng: random.Random = field(default_factory=random.Random, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError(f"error_rate must be within [0, 1], got {self.error_rate}")
        if self.seed is not None:
            self._rng.seed(self.seed)

    def roll(self) -> bool:
        """Whether this call draws a random fault (``error_rate``); counts it. Thread-safe."""
        if not self.error_rate:
            return False
        with self._lock:
            hit = self._rng.random() < self.error_rate
            if hit:
                self.injected += 1
        return hit

    def count(self) -> None:
        with self._lock:
            self.injected += 1


class FaultInjectingTier(WrapperTier):
    """Wraps a tier and injects the faults its :class:`FaultPlan` describes (tests only)."""

    def __init__(self, inner: Tier, plan: FaultPlan | None = None) -> None:
        super().__init__(inner)
        self.plan = plan or FaultPlan()

    def _delay(self) -> None:
        if self.plan.latency_s:
            time.sleep(self.plan.latency_s)

    def _write_fault(self) -> None:
        self._delay()
        if self.plan.write_gate is not None:
            self.plan.write_gate.wait()
        if self.plan.full:
            self.plan.count()
            raise TierFullError(f"{self.name}: injected 'tier full'")
        if self.plan.fail_writes:
            self.plan.count()
            raise TierError(f"{self.name}: injected write failure")
        if self.plan.roll():
            raise TierError(f"{self.name}: injected random write failure")

    def _read_fault(self) -> bool:
        """Whether this read fails (delayed first); an injected read failure is a counted error."""
        self._delay()
        if self.plan.fail_reads:
            self.plan.count()
        elif not self.plan.roll():
            return False
        self.inner.stats.add("errors")
        return True

    def reserve(self, key: ObjectKey, nbytes: int, *, tenant: bytes = DEFAULT_TENANT) -> WriteHandle:
        self._write_fault()
        return super().reserve(key, nbytes, tenant=tenant)

    def reserve_many(
        self, items: Sequence[tuple[ObjectKey, int]], *, tenants: Sequence[bytes] = ()
    ) -> list[WriteHandle]:
        self._write_fault()  # one fault for the batch, as the inner tier reserves it whole
        return super().reserve_many(items, tenants=tenants)

    def put(
        self,
        key: ObjectKey,
        data: bytes | bytearray | memoryview,
        *,
        owed: bool = False,
        tenant: bytes = DEFAULT_TENANT,
        digest: int | None = None,
    ) -> None:
        self._write_fault()
        super().put(key, data, owed=owed, tenant=tenant, digest=digest)

    def pin(self, key: ObjectKey, *, count: bool = True) -> ReadHandle | None:
        if self._read_fault():
            return None
        return super().pin(key, count=count)

    def pin_many(self, keys: Sequence[ObjectKey], *, count: bool = True) -> list[ReadHandle | None]:
        return [self.pin(key, count=count) for key in keys]  # each read may fail on its own

    def pin_all(self, raws: Sequence[bytes]) -> HeldSet | None:
        return None  # the caller pins key by key (pin_many), where each read may fail on its own

    def get(self, key: ObjectKey) -> bytes | None:
        if self._read_fault():
            return None
        return super().get(key)

    def read_into(self, key: ObjectKey, alloc: Callable[[int], memoryview]) -> int | None:
        if self._read_fault():
            return None
        return super().read_into(key, alloc)

    def contains(self, key: ObjectKey) -> bool:
        self._delay()
        if self.plan.fail_reads:
            return False
        return super().contains(key)

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        self._delay()
        if self.plan.fail_reads:
            return [False] * len(keys)
        return super().contains_many(keys)

    def committed_keys(self, raws: Sequence[bytes]) -> list[ObjectKey | None]:
        self._delay()
        if self.plan.fail_reads:
            return [None] * len(raws)
        return super().committed_keys(raws)
