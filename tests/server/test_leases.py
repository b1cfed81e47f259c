"""Specification: a release says which leases had expired first, so no reader trusts bytes that
no lease protected for the whole copy."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.server.conftest import StartServer, manifest
from tiercache.cli.app import main
from tiercache.client.client import Client
from tiercache.client.transfer import Load
from tiercache.keys import Fingerprint, ObjectKey, chunk_hashes
from tiercache.testing.poll import stop_process, wait_until

# Short enough to wait out, long enough that a pin and its release on a loaded shared host are in time.
TTL_S = 1.0


def stored_keys(client: Client, n: int) -> list[ObjectKey]:
    [group] = client.register([(0, manifest())])
    keys = [ObjectKey(Fingerprint(group.fingerprint), 0, h) for h in chunk_hashes(list(range(256 * n)), 256)]
    client.store_chunks(keys, [bytes([i]) * 4096 for i in range(n)])
    return keys


def test_a_lease_released_in_time_is_confirmed_and_an_expired_one_is_named(start_server: StartServer) -> None:
    server = start_server(l1_lease_ttl_s=TTL_S)
    with server.client() as client:
        kept, late = stored_keys(client, 2)
        [held] = client.pin([kept])
        assert held is not None
        assert client.release_leases([held.token]) == set()
        [expiring] = client.pin([late])
        assert expiring is not None
        time.sleep(TTL_S * 3)  # the copy "took" longer than the lease
        assert client.release_leases([expiring.token]) == {expiring.token}
        assert client.stats()["server"]["leases_lost"] == 1


def test_leases_a_silent_client_let_expire_count_as_lost_when_its_session_ends(
    start_server: StartServer,
) -> None:
    server = start_server(l1_lease_ttl_s=0.2, options={"heartbeat_timeout_s": 1.0})
    with server.client() as watcher:
        silent = server.client(heartbeat=False)
        [key] = stored_keys(silent, 1)
        assert silent.pin([key])[0] is not None  # then never released: the client stalls
        stats = wait_until(
            lambda: (s := watcher.stats()["server"])["leases"] == 0 and s,
            what="the silent client's session to end",
        )
        assert stats["leases_lost"] == 1  # it may have copied under the lease after it expired
        silent.close()


def test_inspect_summary_names_the_lost_leases(
    start_server: StartServer, capsys: pytest.CaptureFixture[str]
) -> None:
    server = start_server(l1_lease_ttl_s=TTL_S)
    with server.client() as client:
        [key] = stored_keys(client, 1)
        [slot] = client.pin([key])
        assert slot is not None
        time.sleep(TTL_S * 3)
        client.release_leases([slot.token])
    assert main(["inspect", "summary", "--server", server.endpoint]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "leases lost: 1 (copies outlived their lease; the loads were recomputed); raise --l1-lease-ttl-s"
        in out
    )
    assert "requests refused unsigned: 0" in out


def test_load_chunks_gives_a_miss_for_a_copy_whose_lease_expired(start_server: StartServer) -> None:
    server = start_server(l1_lease_ttl_s=TTL_S)
    with server.client() as client:
        [key] = stored_keys(client, 1)
        arena_view = client.arena().view  # a copy that stalls past the lease, as a slow reader's would

        def slow_view(offset: int, nbytes: int) -> memoryview:
            time.sleep(TTL_S * 3)
            return arena_view(offset, nbytes)

        client.arena().view = slow_view  # type: ignore[method-assign]
        assert client.load_chunks([key]) == [None]
        client.arena().view = arena_view  # type: ignore[method-assign]
        assert client.load_chunks([key]) == [bytes([0]) * 4096]


def test_a_release_well_inside_its_leases_is_sent_without_waiting_for_the_reply(
    start_server: StartServer,
) -> None:
    server = start_server(l1_lease_ttl_s=TTL_S)
    with server.client(timeout=1.0) as client, server.client() as watcher:
        assert client.server.lease_ttl_s == TTL_S  # said at hello
        keys = stored_keys(client, 2)
        load = Load.pin(client, keys)
        assert len(load.tokens) == 1  # both in L1: one lease holds the pair
        stop_process(server.process.pid)  # nobody would answer a release now
        try:
            # Within half the lease TTL of the pin, both leases held for the whole copy.
            assert load.finish() == set()
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        wait_until(lambda: watcher.stats()["server"]["leases"] == 0, timeout=10, what="the release to land")
        assert watcher.stats()["server"]["leases_lost"] == 0


def test_a_release_past_that_window_asks_the_server_and_hears_of_the_expired_lease(
    start_server: StartServer,
) -> None:
    server = start_server(l1_lease_ttl_s=TTL_S)
    with server.client() as client:
        [key] = stored_keys(client, 1)
        load = Load.pin(client, [key])
        assert load.slots[0] is not None
        time.sleep(TTL_S * 3)  # the copy "took" longer than the lease
        assert load.finish() == {0}  # slot 0's copy is not vouched for
        assert client.stats()["server"]["leases_lost"] == 1


def test_a_loads_release_rides_the_next_pin_and_is_applied_before_it(start_server: StartServer) -> None:
    """A load whose copy time alone vouches for (well inside the leases) sends no release of its
    own: the release is held back and carried by the client's next pin, which the server applies
    first. The server reads one message per load where it read two."""
    server = start_server()
    with server.client(heartbeat=False) as client:
        keys = stored_keys(client, 2)
        assert client.load_chunks(keys) == [bytes([0]) * 4096, bytes([1]) * 4096]
        held = client.stats()["server"]  # not a pin: the release stays behind
        assert client.load_chunks(keys) == [bytes([0]) * 4096, bytes([1]) * 4096]  # carries it
        after = client.stats()["server"]
    assert held["leases"] == 2 and after["leases"] == 2  # the second load's only
    assert after["requests"] - held["requests"] == 2  # the pin and this stats
    assert after["leases_lost"] == after["releases_skipped"] == 0


def test_held_back_lease_releases_go_quietly_when_flushed_skipping_what_the_session_does_not_hold(
    start_server: StartServer,
) -> None:
    """What no pin took along goes in one quiet release (unanswered). A token the session does not
    hold (released already, or another client's) is skipped and counted, never refused: the
    session's other leases are released, the other client's lease is left alone."""
    server = start_server()
    with server.client(heartbeat=False) as client, server.client(heartbeat=False) as other:
        keys = stored_keys(client, 2)
        first, second = (Load.pin(client, [key]) for key in keys)
        [theirs] = other.pin(keys[:1])
        assert theirs is not None
        assert client.release_leases(first.tokens) == set()
        before = client.stats()["server"]
        client.release_leases_later([*first.tokens, *second.tokens, theirs.token])
        client.flush_releases()
        after = client.stats()["server"]
        assert other.release_leases([theirs.token]) == set()  # still its own
    assert before["leases"] == 2 and after["leases"] == 1  # the other client's
    assert after["releases_skipped"] - before["releases_skipped"] == 2
    assert after["requests"] - before["requests"] == 2  # the release and this stats
    assert after["replies"] - before["replies"] == 1


def test_a_held_back_release_is_sent_within_a_quarter_of_the_lease_window_however_busy_the_client(
    start_server: StartServer,
) -> None:
    """The heartbeat thread sends releases no pin took along once they have waited a quarter of
    the lease window (at most a second), even while the client keeps talking to the server, so a
    client that stops loading does not keep its last objects pinned."""
    server = start_server(l1_lease_ttl_s=4 * TTL_S)
    with server.client() as client:
        keys = stored_keys(client, 2)
        client.load_chunks(keys)
        assert client.stats()["server"]["leases"] == 2
        deadline = time.monotonic() + 10
        while client.stats()["server"]["leases"] and time.monotonic() < deadline:
            time.sleep(0.05)  # every stats is a request: the client is never silent
        assert client.stats()["server"]["leases"] == 0
        assert client.stats()["server"]["leases_lost"] == 0


def test_a_pin_l1_answers_whole_is_one_lease_and_a_pin_with_a_miss_a_lease_per_object_found(
    start_server: StartServer,
) -> None:
    """A pin whose every object is in L1 (a load's usual case) holds them as one lease, as a
    lookup's ticket does: every slot names its token, one release ends it, and if it expired first
    every object's copy is lost. A pin with a miss leases each object it found."""
    server = start_server(l1_lease_ttl_s=TTL_S)
    with server.client(heartbeat=False) as client:
        keys = stored_keys(client, 3)
        missing = ObjectKey(keys[0].fingerprint, 0, bytes(16))
        before = client.stats()
        whole = client.pin(keys)
        partial = client.pin([*keys[:2], missing])
        after = client.stats()
        assert all(whole) and len({s.token for s in whole if s}) == 1
        assert partial[2] is None and len({s.token for s in partial if s}) == 2
        assert after["server"]["leases"] == 5  # leased objects: the whole pin's three, the pair
        assert after["tiers"]["l1"]["hits"] - before["tiers"]["l1"]["hits"] == 5  # counted at the pins
        assert client.release([s.token for s in partial if s]) == 2
        time.sleep(TTL_S * 2)  # the whole pin's lease expires
        assert client.release_leases([whole[0].token]) == {whole[0].token}  # every slot of it
        assert client.stats()["server"]["leases_lost"] == 3
