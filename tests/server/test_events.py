"""Specification: the server's residency log says which tier gained and which lost each object,
numbered, so a client can follow it (the connector turns it into vLLM KV events for routers).

Through a real server process; the bounded-log rules (``lost``, ``more``) on the log itself."""

from __future__ import annotations

from pathlib import Path

from tests.server.conftest import StartServer, manifest
from tests.server.test_data_path import prompt_hashes, store_prompt
from tiercache.client.client import Client
from tiercache.keys import Fingerprint, ObjectKey
from tiercache.server.events import ResidencyLog
from tiercache.testing.poll import wait_until
from tiercache.tier import EvictionReason
from tiercache.wire.protocol import EventKind, Events

KiB = 1 << 10
MiB = 1 << 20


def follow(
    client: Client, since: int, fingerprints: list[Fingerprint]
) -> tuple[int, list[tuple[str, str, bytes]]]:
    """Every change after ``since`` as ``(kind, tier, key)``, and the new position."""
    out: list[tuple[str, str, bytes]] = []
    while True:
        reply = client.events(since, fingerprints)
        assert not reply.lost
        out.extend((e.kind.value, e.tier, e.key) for e in reply.events)
        since = reply.next_seq
        if not reply.more:
            return since, out


def test_a_store_is_reported_once_per_tier_it_lands_in(start_server: StartServer, tmp_path: Path) -> None:
    server = start_server(disk_path=str(tmp_path / "lmdb"))
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        fp = Fingerprint(group.fingerprint)
        start = client.events().next_seq  # no since: no changes, just where the log stands
        keys = list(store_prompt(client, group, prompt_hashes(3)))
        raw = [k.to_bytes() for k in keys]

        def both_tiers() -> bool:
            return len(follow(client, start, [fp])[1]) == 6

        wait_until(both_tiers, timeout=10, what="write-through to disk")
        _, changes = follow(client, start, [fp])
        assert sorted(changes) == sorted(
            [("stored", "l1", k) for k in raw] + [("stored", "disk", k) for k in raw]
        )
        # Another engine's layout is filtered out; no filter sees everything.
        other = Fingerprint(client.register([(0, manifest(model_id="another"))])[0].fingerprint)
        assert follow(client, start, [other])[1] == []
        assert len(follow(client, start, [])[1]) == 6


def test_evictions_and_deletes_are_reported_as_removals(start_server: StartServer) -> None:
    # Room for 15 objects of 64 KiB, stored in one reserve (past the default per-client bound).
    server = start_server(l1_bytes=1 * MiB, options={"max_reserved_share_per_client": 1.0})
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        fp = Fingerprint(group.fingerprint)
        start = client.events().next_seq
        first = list(store_prompt(client, group, prompt_hashes(8, seed=1)))
        store_prompt(client, group, prompt_hashes(10, seed=2))  # 18 objects: evicts the oldest
        _, changes = follow(client, start, [fp])
        removed = [key for kind, tier, key in changes if kind == "removed" and tier == "l1"]
        assert removed and set(removed) <= {k.to_bytes() for k in first}
        at = follow(client, start, [fp])[0]
        kept = [k for k in first if k.to_bytes() not in removed]
        assert client.delete(kept[0]) == 1
        assert follow(client, at, [fp])[1] == [("removed", "l1", kept[0].to_bytes())]


def test_a_restarted_server_is_told_apart_by_its_instance(start_server: StartServer) -> None:
    a, b = start_server(), start_server()
    with a.client() as ca, b.client() as cb:
        assert ca.events().instance != cb.events().instance
        # A position from another instance is not an error: nothing newer than it is known here.
        assert cb.events(since=10**9).events == []


def key(i: int) -> ObjectKey:
    return ObjectKey(Fingerprint(bytes(16)), 0, i.to_bytes(16, "big"))


def test_a_client_that_falls_behind_the_bounded_log_is_told_so() -> None:
    log = ResidencyLog(capacity=4)
    assert log.read(Events()).next_seq == 0
    for i in range(1, 7):
        log.stored("l1")([key(i)])
    behind = log.read(Events(since=1))
    assert behind.lost  # changes 2 (and 1) fell out: only 3..6 are left
    assert [e.seq for e in behind.events] == [3, 4, 5, 6] and behind.next_seq == 6
    fresh = log.read(Events(since=4))
    assert not fresh.lost and [e.seq for e in fresh.events] == [5, 6]


def test_a_reply_scans_at_most_limit_changes_and_says_more_remain() -> None:
    log = ResidencyLog()
    log.read(Events())
    for i in range(1, 6):
        log.removed("disk")([key(i)], EvictionReason.CAPACITY)
    first = log.read(Events(limit=1))
    assert first.events == [] and first.next_seq == 5  # no since: only the position
    page = log.read(Events(since=1, limit=2))
    assert [(e.seq, e.kind, e.tier) for e in page.events] == [
        (2, EventKind.REMOVED, "disk"),
        (3, EventKind.REMOVED, "disk"),
    ]
    assert page.more and page.next_seq == 3
    rest = log.read(Events(since=3, limit=10))
    assert [e.seq for e in rest.events] == [4, 5] and not rest.more


def test_nothing_is_recorded_until_someone_follows() -> None:
    log = ResidencyLog()
    log.stored("l1")([key(1)])  # nobody asked yet: not recorded
    assert log.read(Events()).next_seq == 0
    log.stored("l1")([key(2)])  # recorded from the first read on
    assert [e.key for e in log.read(Events(since=0)).events] == [key(2).to_bytes()]
