"""Specification: failed hellos wait per peer, doubling, bounded, and forgotten after a quiet spell."""

from __future__ import annotations

from tiercache.server.hellos import FIRST_WAIT_S, FREE_FAILURES, FailedHellos


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_fails_freely_five_times_then_waits_doubling_up_to_the_cap() -> None:
    clock = Clock()
    hellos = FailedHellos(max_wait_s=2.0, clock=clock)
    waits = [hellos.failure("10.0.0.1", "guesser") for _ in range(FREE_FAILURES + 5)]
    assert waits[: FREE_FAILURES - 1] == [0.0] * (FREE_FAILURES - 1)
    assert waits[FREE_FAILURES - 1 :] == [FIRST_WAIT_S * 2**i for i in range(3)] + [2.0, 2.0, 2.0]
    assert hellos.wait_s("10.0.0.1") == 2.0
    assert hellos.wait_s("10.0.0.2") == 0.0  # another address is not slowed
    clock.now += 2.0
    assert hellos.wait_s("10.0.0.1") == 0.0
    assert (hellos.failed, hellos.held) == (FREE_FAILURES + 5, 1)


def test_a_success_or_a_quiet_spell_starts_the_peer_afresh() -> None:
    clock = Clock()
    hellos = FailedHellos(forget_s=60.0, clock=clock)
    for _ in range(FREE_FAILURES + 1):
        hellos.failure("p", "c")
    hellos.success("p")
    assert hellos.wait_s("p") == 0.0 and hellos.failure("p", "c") == 0.0
    for _ in range(FREE_FAILURES):
        hellos.failure("p", "c")
    clock.now += 61.0
    assert hellos.wait_s("p") == 0.0 and hellos.failure("p", "c") == 0.0


def test_the_table_of_peers_is_bounded() -> None:
    hellos = FailedHellos(peers=3, clock=Clock())
    for _ in range(FREE_FAILURES):
        hellos.failure("first", "c")
    for i in range(3):
        hellos.failure(f"other-{i}", "c")
    assert hellos.wait_s("first") == 0.0  # forgotten: the least recently failed went first
    assert hellos.failure("first", "c") == 0.0  # and starts afresh
