"""tiercache.testing.poll: a test sees that a call blocks, or hears that it returned without."""

from __future__ import annotations

import threading

import pytest

from tiercache.testing.poll import blocked_in, wait_blocked


def _wait_for(event: threading.Event) -> bool:
    return event.wait(10)


def test_a_thread_waiting_on_an_event_inside_the_call_is_blocked_in_it() -> None:
    event = threading.Event()
    waiter = threading.Thread(target=_wait_for, args=(event,), name="waiter")
    waiter.start()
    try:
        wait_blocked(waiter, _wait_for, what="the waiter to wait for the event")
        assert blocked_in(waiter, _wait_for)
        assert not blocked_in(waiter, test_a_thread_waiting_on_an_event_inside_the_call_is_blocked_in_it)
        assert not blocked_in(waiter, _wait_for, on=threading.Event.set)  # not its innermost frame
    finally:
        event.set()
        waiter.join(10)
    assert not blocked_in(waiter, _wait_for)  # returned


def test_a_call_that_returns_without_blocking_fails_the_wait_at_once() -> None:
    event = threading.Event()
    event.set()
    waiter = threading.Thread(target=_wait_for, args=(event,), name="waiter")
    waiter.start()
    with pytest.raises(AssertionError, match="'waiter' ended without blocking"):
        wait_blocked(waiter, _wait_for, what="the waiter to wait for the event")
