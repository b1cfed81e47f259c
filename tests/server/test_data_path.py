"""Specification: chunks stored through the shared arena come back identical, from every tier."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import S3Endpoint
from tests.server.conftest import StartServer, manifest
from tiercache.client.client import Client
from tiercache.keys import ObjectKey, chunk_hashes
from tiercache.wire.protocol import GroupRef, TicketStateName

MiB = 1 << 20

KiB = 1 << 10


def prompt_hashes(n_chunks: int, seed: int = 0) -> list[bytes]:
    tokens = [(seed * 7919 + i) % 32000 for i in range(n_chunks * 256)]
    return chunk_hashes(tokens, 256)


def store_prompt(
    client: Client, group: GroupRef, hashes: list[bytes], nbytes: int = 64 * KiB
) -> dict[ObjectKey, bytes]:
    from tiercache.keys import Fingerprint

    fp = Fingerprint(group.fingerprint)
    keys = [ObjectKey(fp, group.object_group, h) for h in hashes]
    data = {k: os.urandom(nbytes) for k in keys}
    assert client.store_chunks(keys, [data[k] for k in keys]) == len(keys)
    return data


def test_register_store_lookup_load_returns_identical_bytes(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as client:
        info = client.server
        assert info.chunk_size == 256 and info.arena_size > 0 and info.arena_name
        [group] = client.register([(0, manifest())])
        hashes = prompt_hashes(8)
        stored = store_prompt(client, group, hashes)

        found = client.lookup(hashes, [group])
        assert found.chunks == 8
        assert found.per_tier == {"l1": 8}
        assert found.state is TicketStateName.READY
        assert client.read_ticket(found) == stored

        keys = list(stored)
        assert client.load_chunks(keys) == [stored[k] for k in keys]


def test_lookup_of_a_longer_prompt_reports_the_stored_prefix(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        hashes = prompt_hashes(6)
        store_prompt(client, group, hashes[:4])
        found = client.lookup(hashes, [group], prefetch=False)
        assert (found.chunks, found.state) == (4, TicketStateName.NONE)


def test_async_lookup_lets_the_scheduler_poll_without_waiting(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        hashes = prompt_hashes(4)
        store_prompt(client, group, hashes)
        req = client.lookup_async(hashes, [group], prefetch=False)
        result = None
        while result is None:
            result = client.poll(req)
        assert result.chunks == 4
        # Or wait for it, bounded: the reply is there well within 10 s, and poll returns then.
        req = client.lookup_async(hashes, [group], prefetch=False)
        result = client.poll(req, wait_s=10.0)
        assert result is not None and result.chunks == 4


def restart_and_load(
    start_server: StartServer,
    stored: dict[ObjectKey, bytes],
    hashes: list[bytes],
    group: GroupRef,
    tier: str,
    **kw: object,
) -> None:
    server = start_server(**kw)
    with server.client() as client:
        found = client.lookup(hashes, [group])
        assert found.chunks == len(hashes)
        assert found.per_tier == {tier: len(hashes)}
        assert found.state in (TicketStateName.PENDING, TicketStateName.READY)
        assert found.awaiting == 0  # a promotion, not a wait for another client's store
        ready = client.wait_ticket(found.ticket) if found.pending else found
        assert ready.state is TicketStateName.READY and ready.ready_chunks == len(hashes)
        assert client.read_ticket(ready) == stored
        assert client.lookup(hashes, [group], prefetch=False).per_tier == {"l1": len(hashes)}


def test_lookup_promotes_from_disk_after_a_restart(start_server: StartServer, tmp_path: Path) -> None:
    disk = str(tmp_path / "lmdb")
    first = start_server(disk_path=disk)
    with first.client() as client:
        [group] = client.register([(0, manifest())])
        hashes = prompt_hashes(16)
        stored = store_prompt(client, group, hashes)
    assert first.stop() == 0  # a clean stop flushes the write-through queue to disk
    restart_and_load(start_server, stored, hashes, group, "disk", disk_path=disk)


def test_lookup_promotes_from_s3_after_a_restart(start_server: StartServer, s3: S3Endpoint) -> None:
    first = start_server(s3_url=s3.url)
    with first.client() as client:
        [group] = client.register([(0, manifest())])
        hashes = prompt_hashes(8)
        stored = store_prompt(client, group, hashes)
    assert first.stop() == 0
    restart_and_load(start_server, stored, hashes, group, "s3", s3_url=s3.url)


@pytest.mark.parametrize("nbytes", [2000, 3 * MiB + 5], ids=["one frame", "several frames"])
def test_put_and_get_through_the_socket(start_server: StartServer, nbytes: int) -> None:
    server = start_server()
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        from tiercache.keys import Fingerprint

        key = ObjectKey(Fingerprint(group.fingerprint), 0, prompt_hashes(1)[0])
        data = os.urandom(nbytes)
        assert client.put(key, data)
        assert client.get(key) == data
        assert client.delete(key) == 1
        assert client.get(key) is None


def test_a_lookup_then_a_load_of_its_chunks_counts_each_chunk_as_one_l1_hit(
    start_server: StartServer,
) -> None:
    # The connector's path: a lookup (which pins the hit for its ticket), then the worker pins the
    # same objects again to copy them. Hits are what lookups and reads found, not how many times a
    # found object was pinned, or hit rates and bytes read would be inflated.
    server = start_server()
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        hashes = prompt_hashes(4)
        stored = store_prompt(client, group, hashes)
        before = client.stats()["tiers"]["l1"]
        found = client.lookup(hashes, [group])
        assert found.chunks == 4
        slots = client.pin(list(stored))
        assert all(s is not None for s in slots)
        client.release([s.token for s in slots if s is not None])
        client.release_ticket(found.ticket)
        after = client.stats()["tiers"]["l1"]
    assert after["hits"] - before["hits"] == 4
    assert after["bytes_read"] - before["bytes_read"] == 4 * 64 * KiB


@pytest.mark.parametrize("read", [True, False], ids=["read", "unread"])
def test_a_ticket_released_as_read_counts_each_chunk_as_one_l1_hit(
    start_server: StartServer, read: bool
) -> None:
    """The connector's load from the ticket's own slots (no pin of the worker's): the release says
    the objects were read, and the server counts what a pin's read would have. A ticket released
    unread (the request computed instead) counts nothing. The reply names the arena its slots are
    in: the server's."""
    server = start_server()
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        hashes = prompt_hashes(4)
        store_prompt(client, group, hashes)
        before = client.stats()["tiers"]["l1"]
        found = client.lookup(hashes, [group])
        assert found.chunks == 4 and len(found.slots) == 4
        assert found.arena == client.server.arena_name
        client.release_ticket(found.ticket, read=read)
        after = client.stats()["tiers"]["l1"]
    assert after["hits"] - before["hits"] == (4 if read else 0)
    assert after["bytes_read"] - before["bytes_read"] == (4 * 64 * KiB if read else 0)


def test_a_quiet_ticket_release_unpins_before_the_next_request_and_gets_no_reply(
    start_server: StartServer,
) -> None:
    """``release_ticket_unconfirmed`` (how the vLLM scheduler and the SGLang backend release) sends a
    ``quiet`` release: the server unpins the ticket and counts its objects as read before it handles
    the connection's next request, and sends no reply (one it would encode and send for nobody)."""
    server = start_server()
    with server.client(heartbeat=False) as client:
        [group] = client.register([(0, manifest())])
        hashes = prompt_hashes(4)
        store_prompt(client, group, hashes)
        found = client.lookup(hashes, [group])
        assert found.chunks == 4 and found.ticket
        before = client.stats()
        client.release_ticket_unconfirmed(found.ticket, read=True)
        after = client.stats()  # the connection's next request: handled after the release
    assert before["server"]["tickets"] == 1 and after["server"]["tickets"] == 0
    assert after["tiers"]["l1"]["hits"] - before["tiers"]["l1"]["hits"] == 4
    # Between the two snapshots: the release and the second stats asked, only the first stats answered.
    assert after["server"]["requests"] - before["server"]["requests"] == 2
    assert after["server"]["replies"] - before["server"]["replies"] == 1


def test_a_release_held_back_rides_the_next_lookup_and_is_applied_before_it(
    start_server: StartServer,
) -> None:
    """``release_ticket_later`` (how the vLLM scheduler releases): the client sends nothing until
    its next lookup, which carries the release; the server ends the ticket (its objects counted as
    read) before it answers that lookup, and reads one message where it read two."""
    server = start_server()
    with server.client(heartbeat=False) as client:
        [group] = client.register([(0, manifest())])
        hashes = prompt_hashes(4)
        store_prompt(client, group, hashes)
        found = client.lookup(hashes, [group])
        client.release_ticket_later(found.ticket, read=True)
        held = client.stats()  # not a lookup: the release stays behind
        again = client.lookup(hashes, [group])  # carries it
        after = client.stats()
    assert held["server"]["tickets"] == 1 and after["server"]["tickets"] == 1  # only the new one
    assert again.ticket != found.ticket and again.chunks == 4
    assert after["tiers"]["l1"]["hits"] - held["tiers"]["l1"]["hits"] == 4
    assert after["server"]["requests"] - held["server"]["requests"] == 2  # the lookup and this stats
    assert after["server"]["releases_skipped"] == 0


def test_held_back_releases_go_in_one_message_when_flushed_and_unknown_ones_are_skipped(
    start_server: StartServer,
) -> None:
    """What no lookup took along goes in one ``release_tickets`` message (the scheduler sends it
    with its next step), unanswered; a ticket the session no longer holds is skipped and counted,
    and the request carrying it is handled all the same."""
    server = start_server()
    with server.client(heartbeat=False) as client:
        [group] = client.register([(0, manifest())])
        hashes = prompt_hashes(4)
        store_prompt(client, group, hashes)
        tickets = [client.lookup(hashes, [group]).ticket for _ in range(3)]
        client.release_ticket(tickets[0])
        before = client.stats()
        for ticket in tickets:
            client.release_ticket_later(ticket)
        client.flush_releases()
        after = client.stats()
        assert client.lookup(hashes, [group]).chunks == 4  # nothing left to ride: a plain lookup
    assert before["server"]["tickets"] == 2 and after["server"]["tickets"] == 0
    assert after["server"]["releases_skipped"] - before["server"]["releases_skipped"] == 1
    assert after["server"]["requests"] - before["server"]["requests"] == 2
    assert after["server"]["replies"] - before["server"]["replies"] == 1


def test_a_lookup_l1_answers_alone_replies_and_counts_as_one_the_disk_helps_answer(
    start_server: StartServer, tmp_path: Path
) -> None:
    """A lookup whose every chunk is in L1 is answered on the request loop, the others on the I/O
    executor: both give the same kind of reply (a READY ticket whose slots hold the stored bytes)
    and count the same way (engine lookups and hit chunks, the tenant's lookups)."""
    server = start_server(disk_path=str(tmp_path / "disk"))
    tenant = b"tenant-1"
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        hashes = prompt_hashes(6)
        stored = store_prompt(client, group, hashes[:4])
        for asked in (hashes[:4], hashes):  # all in L1; then two chunks nowhere (the disk is asked)
            before = client.stats()
            found = client.lookup(asked, [group], max_chunks=len(asked), tenant=tenant)
            after = client.stats()
            assert (found.chunks, found.per_tier, found.state) == (4, {"l1": 4}, TicketStateName.READY)
            assert found.ready_chunks == 4 and len(found.slots) == 4
            assert client.read_ticket(found) == stored
            assert after["engine"]["lookups"] - before["engine"]["lookups"] == 1
            assert after["engine"]["lookup_chunks_hit"] - before["engine"]["lookup_chunks_hit"] == 4
            label = next(iter(set(after["tenants"]) - {"default", "other"}))
            was = before["tenants"].get(label, {})
            assert after["tenants"][label]["lookups"] - was.get("lookups", 0) == 1
            assert after["tenants"][label]["hit_chunks"] - was.get("hit_chunks", 0) == 4
