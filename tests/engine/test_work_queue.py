"""The write-behind queue: bounded, and waited on through a condition (flush never polls)."""

from __future__ import annotations

import threading

from tiercache.engine.writes import WorkQueue
from tiercache.testing.poll import wait_blocked


def test_a_full_queue_refuses_instead_of_blocking() -> None:
    q: WorkQueue[int] = WorkQueue(2)
    assert q.put_nowait(1) and q.put_nowait(2)
    assert not q.put_nowait(3)
    assert q.qsize() == 2


def test_wait_idle_returns_once_every_item_is_finished_not_merely_taken() -> None:
    q: WorkQueue[int] = WorkQueue(4)
    q.put_nowait(1)
    assert not q.wait_idle(0.01)
    assert q.get() == 1
    assert not q.wait_idle(0.01)  # taken, still being worked on
    idle: list[bool] = []
    waiter = threading.Thread(target=lambda: idle.append(q.wait_idle(5.0)), name="waiter")
    waiter.start()
    wait_blocked(waiter, WorkQueue.wait_idle, what="wait_idle to wait for the item being worked on")
    q.task_done()  # the notify wakes the waiter: it was seen waiting
    waiter.join(10.0)
    assert idle == [True]


def test_a_closed_queue_drains_what_it_holds_then_says_none() -> None:
    q: WorkQueue[int] = WorkQueue(4)
    q.put_nowait(1)
    q.close()
    assert not q.put_nowait(2)
    assert q.get() == 1
    assert q.get() is None


def test_close_wakes_a_waiting_getter() -> None:
    q: WorkQueue[int] = WorkQueue(4)
    got: list[int | None] = []
    getter = threading.Thread(target=lambda: got.append(q.get()))
    getter.start()
    q.close()
    getter.join(5.0)
    assert got == [None]


def test_take_all_removes_what_is_queued_and_counts_it_as_finished() -> None:
    q: WorkQueue[int] = WorkQueue(4)
    q.put_nowait(1)
    q.put_nowait(2)
    assert q.take_all() == [1, 2]
    assert q.qsize() == 0
    assert q.wait_idle(0.0)  # nothing is left to wait for
