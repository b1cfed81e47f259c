"""Cross-cutting behaviour as tier wrappers, not as flags inside every tier.

:class:`WrapperTier` forwards every call to an inner tier; subclasses override what they change.
:class:`FaultInjectingTier` is how tests (and, for testing only, a server started with fault injection)
break a tier on purpose: errors, latency, a gate that holds writes, "disk full". It is never enabled by
default.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from tiercache.errors import TierError, TierFullError
from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey
from tiercache.tier import ReadHandle, Tier, TierStats, TierUsage, WriteHandle


class WrapperTier(Tier):
    """A tier that forwards everything to ``inner``; shares its name, stats and flags."""

    def __init__(self, inner: Tier) -> None:
        self.inner = inner
        self.name = inner.name
        self.remote = inner.remote

    @property
    def stats(self) -> TierStats:  # type: ignore[override]
        return self.inner.stats

    @stats.setter
    def stats(self, value: TierStats) -> None:  # Tier.__init__ compatibility; inner owns stats
        pass

    def reserve(self, key: ObjectKey, nbytes: int) -> WriteHandle:
        return self.inner.reserve(key, nbytes)

    def commit(self, handle: WriteHandle, *, owed: bool = False) -> None:
        self.inner.commit(handle, owed=owed)

    def abort(self, handle: WriteHandle) -> None:
        self.inner.abort(handle)

    def contains(self, key: ObjectKey) -> bool:
        return self.inner.contains(key)

    def pin(self, key: ObjectKey, *, count: bool = True) -> ReadHandle | None:
        return self.inner.pin(key, count=count)

    def release(self, handle: ReadHandle) -> None:
        self.inner.release(handle)

    def delete(self, key: ObjectKey) -> bool:
        return self.inner.delete(key)

    def usage(self) -> TierUsage:
        return self.inner.usage()

    def iter_keys(self) -> Iterator[ObjectKey]:
        return self.inner.iter_keys()

    def iter_keys_by_use(self) -> Iterator[ObjectKey]:
        return self.inner.iter_keys_by_use()

    def put(self, key: ObjectKey, data: bytes | bytearray | memoryview, *, owed: bool = False) -> None:
        self.inner.put(key, data, owed=owed)

    def read_into(self, key: ObjectKey, alloc: Callable[[int], memoryview]) -> bool:
        return self.inner.read_into(key, alloc)

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return self.inner.contains_many(keys)

    def lookup_prefix(self, keys: Sequence[ObjectKey]) -> int:
        return self.inner.lookup_prefix(keys)

    def put_manifest(self, fingerprint: Fingerprint, data: bytes) -> None:
        self.inner.put_manifest(fingerprint, data)

    def get_manifest(self, fingerprint: Fingerprint) -> bytes | None:
        return self.inner.get_manifest(fingerprint)

    def iter_manifests(self) -> Iterator[tuple[Fingerprint, bytes]]:
        return self.inner.iter_manifests()

    def settle(self, key: ObjectKey) -> None:
        self.inner.settle(key)

    def flush(self, timeout: float | None = None) -> None:
        self.inner.flush(timeout)

    def close(self) -> None:
        self.inner.close()


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

    def reserve(self, key: ObjectKey, nbytes: int) -> WriteHandle:
        self._write_fault()
        return super().reserve(key, nbytes)

    def put(self, key: ObjectKey, data: bytes | bytearray | memoryview, *, owed: bool = False) -> None:
        self._write_fault()
        super().put(key, data, owed=owed)

    def pin(self, key: ObjectKey, *, count: bool = True) -> ReadHandle | None:
        if self._read_fault():
            return None
        return super().pin(key, count=count)

    def read_into(self, key: ObjectKey, alloc: Callable[[int], memoryview]) -> bool:
        if self._read_fault():
            return False
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
