"""Specification: over the real server, a lookup that asks to wait for chunks another client is still
storing (a prefill engine's stores in flight when its decode engine asks) gets them once committed,
never before, and a bad wait bound is refused."""

from __future__ import annotations

import os

import pytest

from tests.server.conftest import StartServer, manifest
from tests.server.test_data_path import KiB, prompt_hashes, store_prompt
from tiercache.errors import ServerError
from tiercache.keys import Fingerprint, ObjectKey
from tiercache.keys.digest import digest
from tiercache.wire.protocol import TicketStateName


def test_a_consumer_waits_for_a_producers_store_in_flight(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as producer, server.client() as consumer:
        [group] = producer.register([(0, manifest())])
        consumer.register([(0, manifest())])
        hashes = prompt_hashes(4)
        stored = store_prompt(producer, group, hashes[:2])
        keys = [ObjectKey(Fingerprint(group.fingerprint), 0, h) for h in hashes[2:]]
        late = {k: os.urandom(64 * KiB) for k in keys}
        slots = producer.reserve([(k, len(v)) for k, v in late.items()])
        arena = producer.arena()

        without = consumer.lookup(hashes, [group], prefetch=False)
        assert without.chunks == 2  # by default a store in flight is not there yet

        found = consumer.lookup(hashes, [group], inflight_wait_s=30)
        assert (found.chunks, found.state) == (4, TicketStateName.PENDING)
        # The reply says the ticket waits for another client's store (the connector then allows
        # inflight_wait_s on top of timeout_s), not for a promotion.
        assert found.awaiting == 2
        polled = consumer.poll_ticket(found.ticket)
        assert (polled.state, polled.awaiting) == (TicketStateName.PENDING, 2)

        for slot, data in zip(slots, late.values(), strict=True):
            arena.view(slot.offset, slot.nbytes)[:] = data
        producer.commit([s.token for s in slots], [digest(data) for data in late.values()])

        ready = consumer.wait_ticket(found.ticket, timeout=30)
        assert (ready.state, ready.ready_chunks, ready.awaiting) == (TicketStateName.READY, 4, 0)
        assert consumer.read_ticket(ready) == {**stored, **late}
        engine = consumer.stats()["engine"]
        assert (engine["inflight_waits"], engine["inflight_wait_misses"]) == (2, 0)


def test_a_store_that_is_aborted_ends_the_hit(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as producer, server.client() as consumer:
        [group] = producer.register([(0, manifest())])
        hashes = prompt_hashes(3)
        store_prompt(producer, group, hashes[:1])
        keys = [ObjectKey(Fingerprint(group.fingerprint), 0, h) for h in hashes[1:]]
        slots = producer.reserve([(k, 64 * KiB) for k in keys])
        found = consumer.lookup(hashes, [group], inflight_wait_s=30)
        assert found.state is TicketStateName.PENDING
        producer.abort([s.token for s in slots])
        ready = consumer.wait_ticket(found.ticket, timeout=30)
        assert (ready.state, ready.ready_chunks) == (TicketStateName.READY, 1)
        consumer.release_ticket(ready.ticket)


@pytest.mark.parametrize("wait", [-1.0, float("nan"), 3600.0])
def test_a_wait_bound_outside_its_range_is_refused(start_server: StartServer, wait: float) -> None:
    server = start_server()
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        with pytest.raises(ServerError, match="inflight_wait_s"):
            client.lookup(prompt_hashes(1), [group], inflight_wait_s=wait)
        client.ping()  # the server keeps serving
