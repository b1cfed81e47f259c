"""Small test fixtures with no dependencies: a clock tests move by hand, and keys and payloads that
a read can be checked against."""

from __future__ import annotations

from dataclasses import dataclass

from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey


@dataclass
class FakeClock:
    """A monotonic clock the test advances by hand, so expiry is tested without sleeping."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_key(i: int, group: int = 0, fp: bytes = b"F" * 16) -> ObjectKey:
    """A distinct, deterministic key per ``i``."""
    return ObjectKey(Fingerprint(fp), group, i.to_bytes(16, "big"))


def payload_for(key: ObjectKey, nbytes: int) -> bytes:
    """Bytes derived from the key, so any read can be checked against the key it was asked for."""
    seed = key.to_bytes()
    reps = nbytes // len(seed) + 1
    return (seed * reps)[:nbytes]
