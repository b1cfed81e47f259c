"""Specification: one client cannot hold more than its bounds, and tickets end with their leases.

Issue 30, point 5: one client's 20,000 lookup tickets stayed held after every lease expired, and
nothing bounded what one client could pin or reserve. Each bound is a setting; a request past it
gets a ``busy`` reply naming the setting and is counted; every other client is served as before.
Real server processes over ipc, the real ``Client``.
"""

from __future__ import annotations

import pytest

from tests.server.conftest import CHUNK, StartServer, manifest
from tiercache.errors import ServerError
from tiercache.keys import ObjectKey, chunk_hashes
from tiercache.keys.fingerprint import Fingerprint
from tiercache.testing.poll import wait_until

KiB = 1 << 10
MiB = 1 << 20


def test_pins_past_max_holds_per_client_are_refused_and_the_others_are_served(
    start_server: StartServer,
) -> None:
    server = start_server(options={"max_holds_per_client": 100})
    with server.client() as greedy, server.client() as other:
        keys = [ObjectKey(Fingerprint(b"F" * 16), 0, i.to_bytes(16, "big")) for i in range(80)]
        greedy.store_chunks(keys, [b"x" * KiB] * len(keys))
        slots = greedy.pin(keys)  # 80 leases held
        with pytest.raises(ServerError, match="max-holds-per-client 100") as err:
            greedy.pin(keys[:30])
        assert err.value.code == "busy"
        assert len([s for s in other.pin(keys[:30]) if s is not None]) == 30  # its own bound
        greedy.release_leases([s.token for s in slots if s is not None])
        assert len(greedy.pin(keys[:30])) == 30  # released: room again
        assert other.stats()["server"]["refused_holds"] == 1


def test_a_reserve_past_max_reserved_share_per_client_is_refused_and_evicts_nothing(
    start_server: StartServer,
) -> None:
    # One reserve the size of the arena (under made-up tenant ids, quotas on) evicted every object
    # of another tenant. Past the per-client share it is refused before anything is evicted.
    server = start_server(l1_bytes=4 * MiB, l1_options={"tenant_share": 0.5})
    with server.client() as victim, server.client() as greedy:
        kept = [ObjectKey(Fingerprint(b"V" * 16), 0, i.to_bytes(16, "big")) for i in range(20)]
        victim.store_chunks(kept, [b"v" * (100 * KiB)] * len(kept))
        big = [ObjectKey(Fingerprint(fp), 0, b"\0" * 16) for fp in (b"a" * 16, b"b" * 16)]
        with pytest.raises(ServerError, match=r"max-reserved-share-per-client 0\.5") as err:
            greedy.reserve([(k, int(1.5 * MiB)) for k in big], tenants=[b"t" * 8, b"u" * 8])
        assert err.value.code == "busy"
        assert all(s is not None for s in victim.pin(kept))  # every one of its objects is still there
        assert victim.stats()["server"]["refused_reserved_bytes"] == 1
        greedy.store_chunks(big[:1], [b"g" * MiB])  # within the share: served


def test_tickets_end_with_their_leases_and_past_the_bound_lookups_are_refused(
    start_server: StartServer,
) -> None:
    server = start_server(
        l1_lease_ttl_s=0.5, options={"max_tickets_per_client": 4, "heartbeat_timeout_s": 1.0}
    )
    with server.client() as hoarder, server.client() as other:
        [group] = hoarder.register([(0, manifest())])
        hashes = chunk_hashes(list(range(2 * CHUNK)), CHUNK)
        keys = [ObjectKey(Fingerprint(group.fingerprint), group.object_group, h) for h in hashes]
        hoarder.store_chunks(keys, [b"k" * KiB] * len(keys))
        for _ in range(4):  # four tickets, never released
            assert hoarder.lookup(hashes, [group]).ticket
        with pytest.raises(ServerError, match="max-tickets-per-client") as err:
            hoarder.lookup(hashes, [group])
        assert err.value.code == "busy"
        assert other.lookup(hashes, [group]).ticket  # another client is not touched
        # Once their leases have expired, the tickets end by themselves (the server's sweep).
        wait_until(
            lambda: other.stats()["server"]["tickets_expired"] >= 4,
            timeout=10,
            what="the hoarder's tickets to end with their leases",
        )
        stats = other.stats()["server"]
        assert stats["refused_tickets"] == 1
        assert stats["leases_lost"] >= 4 * len(keys)  # held past their TTL: the client may have copied
        assert hoarder.lookup(hashes, [group]).ticket  # room again
