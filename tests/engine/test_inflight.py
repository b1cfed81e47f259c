"""Specification: a lookup may wait for chunks another writer is still storing (a prefill engine's
stores still in flight when its decode engine asks), bounded, and never returns them before commit."""

from __future__ import annotations

import threading

from tests.conftest import payload_for
from tests.engine.conftest import EngineFactory, l1_tier
from tests.engine.test_engine import CHUNK_BYTES, FULL, load_all, prompt, store
from tiercache.engine import TicketState, TieredEngine
from tiercache.l1.tier import L1Tier
from tiercache.testing.poll import wait_blocked
from tiercache.tier.contract import WriteHandle


def reserve(engine: TieredEngine, hashes: list[bytes]) -> list[WriteHandle]:
    """Open a reservation for each chunk and fill it, but commit nothing (a store in flight)."""
    handles = []
    for h in hashes:
        key = FULL.key(h)
        handle = engine.reserve(key, CHUNK_BYTES)
        assert handle is not None
        handle.buffer[:] = payload_for(key, CHUNK_BYTES)
        handles.append(handle)
    return handles


def test_without_asking_a_chunk_being_written_is_a_miss(make_engine: EngineFactory) -> None:
    engine = make_engine(l1_tier())
    hashes = prompt(4)
    store(engine, [FULL], hashes, chunks=[0, 1])
    reserve(engine, hashes[2:])
    assert engine.lookup(hashes, [FULL]).chunks == 2


def test_chunks_being_written_count_and_are_pinned_once_committed(make_engine: EngineFactory) -> None:
    engine = make_engine(l1_tier())
    hashes = prompt(4)
    store(engine, [FULL], hashes, chunks=[0, 1])
    writes = reserve(engine, hashes[2:])

    found = engine.lookup(hashes, [FULL], inflight=True)
    assert (found.chunks, found.per_tier, found.inflight) == (4, {"l1": 4}, 2)
    ticket = engine.prefetch(hashes, [FULL], 4, inflight_wait_s=30)
    assert engine.poll(ticket) is TicketState.PENDING
    assert set(ticket.handles) == {FULL.key(h) for h in hashes[:2]}  # never an uncommitted one

    engine.commit(writes[0])
    assert engine.poll(ticket) is TicketState.PENDING
    engine.commit(writes[1])
    assert engine.poll(ticket) is TicketState.READY
    assert ticket.chunks == 4
    load_all(engine, ticket)  # the committed bytes
    engine.release_ticket(ticket)
    assert engine.counters.snapshot()["inflight_waits"] == 2
    assert engine.counters.snapshot()["inflight_wait_misses"] == 0


def test_an_aborted_write_ends_the_hit_before_its_chunk(make_engine: EngineFactory) -> None:
    engine = make_engine(l1_tier())
    hashes = prompt(4)
    store(engine, [FULL], hashes, chunks=[0])
    writes = reserve(engine, hashes[1:])
    ticket = engine.prefetch(hashes, [FULL], 4, inflight_wait_s=30)
    engine.commit(writes[0])
    engine.abort(writes[1])  # chunk 2 will never come: the hit is chunks 0 and 1
    engine.commit(writes[2])
    assert engine.poll(ticket) is TicketState.READY
    assert ticket.chunks == 2
    assert set(ticket.handles) == {FULL.key(h) for h in hashes[:2]}  # nothing past the boundary
    engine.release_ticket(ticket)
    assert engine.counters.snapshot()["inflight_wait_misses"] == 1


def test_the_wait_is_bounded(make_engine: EngineFactory) -> None:
    engine = make_engine(l1_tier())
    hashes = prompt(2)
    store(engine, [FULL], hashes, chunks=[0])
    writes = reserve(engine, hashes[1:])
    ticket = engine.prefetch(hashes, [FULL], 2, inflight_wait_s=0.05)
    assert engine.wait(ticket, timeout=10) is TicketState.READY  # returns at the 0.05 s bound
    assert ticket.chunks == 1
    engine.release_ticket(ticket)
    engine.commit(writes[0])  # too late for that ticket; the next lookup finds it
    assert engine.lookup(hashes, [FULL]).chunks == 2


def test_wait_blocks_on_the_commit_itself(make_engine: EngineFactory) -> None:
    engine = make_engine(l1_tier())
    hashes = prompt(3)
    writes = reserve(engine, hashes)
    ticket = engine.prefetch(hashes, [FULL], 3, inflight_wait_s=30)
    states: list[TicketState] = []
    waiter = threading.Thread(target=lambda: states.append(engine.wait(ticket, timeout=30)), name="waiter")
    waiter.start()
    try:  # seen waiting on L1 for the open reservations, and only then are they committed
        wait_blocked(waiter, L1Tier.wait_written, what="engine.wait to wait for the chunks' commits")
    finally:
        for w in writes:
            engine.commit(w)
        waiter.join(30)
    assert states == [TicketState.READY]
    assert ticket.chunks == 3
    load_all(engine, ticket)
    engine.release_ticket(ticket)


def test_a_released_ticket_stops_waiting(make_engine: EngineFactory) -> None:
    engine = make_engine(l1_tier())
    hashes = prompt(1)
    [write] = reserve(engine, hashes)
    ticket = engine.prefetch(hashes, [FULL], 1, inflight_wait_s=30)
    engine.release_ticket(ticket)
    engine.commit(write)
    assert engine.poll(ticket) is TicketState.MISS
    assert not ticket.handles  # nothing pinned for a ticket nobody holds
