"""A stateful property test against a dict model: a hit always returns exactly the bytes stored
under that key, a pinned object is never evicted, and the arena never loses or double-counts bytes."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.conftest import FakeClock, make_key
from tiercache.config import EvictionPolicyName, L1Config
from tiercache.errors import TierFullError
from tiercache.l1.arena import default_arena_name
from tiercache.l1.tier import L1Tier
from tiercache.tier import ReadHandle

UNIT = 4096
SIZE = 8 * UNIT
LEASE_TTL = 50.0


class L1Machine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.tier: L1Tier | None = None
        self.model: dict[int, bytes] = {}  # what the latest commit stored per key
        self.pins: list[tuple[ReadHandle, bytes, float]] = []  # handle, bytes seen, pinned at
        self.version = 0

    @rule(policy=st.sampled_from(list(EvictionPolicyName)))
    @precondition(lambda self: self.tier is None)
    def open(self, policy: EvictionPolicyName) -> None:
        config = L1Config(
            size_bytes=SIZE, name=default_arena_name(), eviction_policy=policy, lease_ttl_s=LEASE_TTL
        )
        self.tier = L1Tier(config, clock=self.clock)

    @rule(k=st.integers(0, 9), nbytes=st.integers(0, 3 * UNIT), owed=st.booleans())
    @precondition(lambda self: self.tier is not None)
    def put(self, k: int, nbytes: int, owed: bool) -> None:
        self.version += 1
        data = (self.version.to_bytes(4, "big") + bytes([k])) * (nbytes // 5 + 1)
        data = data[:nbytes]
        try:
            self.tier.put(make_key(k), data, owed=owed)
        except TierFullError:
            return
        self.model[k] = data

    @rule(k=st.integers(0, 9))
    @precondition(lambda self: self.tier is not None)
    def pin(self, k: int) -> None:
        handle = self.tier.pin(make_key(k))
        if handle is not None:
            assert bytes(handle.buffer) == self.model[k]
            self.pins.append((handle, bytes(handle.buffer), self.clock.now))

    @rule(i=st.integers(0, 20))
    @precondition(lambda self: self.tier is not None and self.pins)
    def release(self, i: int) -> None:
        handle, _, _ = self.pins.pop(i % len(self.pins))
        self.tier.release(handle)

    @rule(k=st.integers(0, 9))
    @precondition(lambda self: self.tier is not None)
    def settle(self, k: int) -> None:
        self.tier.settle(make_key(k))

    @rule(k=st.integers(0, 9))
    @precondition(lambda self: self.tier is not None)
    def delete(self, k: int) -> None:
        present = self.tier.contains(make_key(k))
        assert self.tier.delete(make_key(k)) is present
        assert not self.tier.contains(make_key(k))
        self.model.pop(k, None)

    @rule(seconds=st.sampled_from([1.0, 20.0, 60.0]))
    @precondition(lambda self: self.tier is not None)
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @invariant()
    def hits_return_the_latest_committed_bytes(self) -> None:
        if self.tier is None:
            return
        for key in self.tier.iter_keys():
            k = int.from_bytes(key.prefix_hash, "big")
            assert self.tier.get(key) == self.model[k]

    @invariant()
    def pinned_bytes_never_change_while_the_lease_lasts(self) -> None:
        for handle, seen, pinned_at in self.pins:
            if self.clock.now < pinned_at + LEASE_TTL:
                assert bytes(handle.buffer) == seen

    @invariant()
    def bytes_are_accounted(self) -> None:
        if self.tier is None:
            return
        usage = self.tier.usage()
        assert 0 <= self.tier.free_bytes() <= SIZE
        assert usage.bytes_used <= SIZE - self.tier.free_bytes()

    def teardown(self) -> None:
        if self.tier is not None:
            self.tier.close()


TestL1StateMachine = L1Machine.TestCase
TestL1StateMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
