"""Specification: one tenant's flood does not evict everyone else.

Through a real server process: tenant Alice keeps a working set within her L1 share and asks for
it again and again while tenant Flood stores ten times its own share. With quotas on, every one of
Alice's lookups finds her whole working set, none of her objects is evicted, and the flood's
evictions are counted (in the ``stats`` reply, ``tiercache inspect summary --by-tenant`` and
``/metrics``). The control run, quotas off, shows the flood evicting Alice: the test can fail.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import StartServer, manifest
from tests.server.test_data_path import prompt_hashes
from tiercache.cli.app import main
from tiercache.client.client import Client
from tiercache.keys import Fingerprint, ObjectKey
from tiercache.keys.tenant import tenant_id, tenant_label
from tiercache.server.metrics import render
from tiercache.server.tenants import top
from tiercache.testing.poll import wait_until
from tiercache.wire.protocol import GroupRef

KiB = 1 << 10
OBJECT = 64 * KiB
ARENA_OBJECTS = 64  # a 4 MiB arena
ALICE = tenant_id("alice-salt")
FLOOD = tenant_id("flood-salt")
DOCS = 8  # Alice's working set: 8 prompts of 2 chunks = 16 objects, a quarter of the arena
FLOOD_OBJECTS = 10 * ARENA_OBJECTS // 2  # ten times a half share


def keys_of(group: GroupRef, hashes: list[bytes]) -> list[ObjectKey]:
    return [ObjectKey(Fingerprint(group.fingerprint), group.object_group, h) for h in hashes]


def run_flood(client: Client, group: GroupRef) -> tuple[list[float], dict[str, Any]]:
    """Alice stores her documents, then the flood stores in batches of 8 objects; after each batch
    Alice asks for every document again. Returns the share of her chunks each round found, and the
    server's stats at the end."""
    docs = [prompt_hashes(2, seed=i) for i in range(DOCS)]
    for hashes in docs:
        keys = keys_of(group, hashes)
        assert client.store_chunks(keys, [os.urandom(OBJECT) for _ in keys], tenant=ALICE) == 2
    rounds: list[float] = []
    flood = keys_of(group, prompt_hashes(FLOOD_OBJECTS, seed=1000))
    for start in range(0, FLOOD_OBJECTS, 8):
        batch = flood[start : start + 8]
        assert client.store_chunks(batch, [os.urandom(OBJECT) for _ in batch], tenant=FLOOD) == 8
        found = sum(client.lookup(h, [group], prefetch=False, tenant=ALICE).chunks for h in docs)
        rounds.append(found / (2 * DOCS))
    return rounds, client.stats()


def test_a_tenant_flooding_ten_times_its_share_leaves_the_other_tenants_working_set_alone(
    start_server: StartServer, capsys: pytest.CaptureFixture[str]
) -> None:
    server = start_server(l1_bytes=ARENA_OBJECTS * OBJECT, l1_options={"tenant_share": 0.5})
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        rounds, stats = run_flood(client, group)

    assert rounds == [1.0] * len(rounds)  # every lookup of Alice's found all 16 chunks
    alice, flood = stats["tenants"][tenant_label(ALICE)], stats["tenants"][tenant_label(FLOOD)]
    assert alice["tiers"]["l1"]["evictions"] == 0 and alice["tiers"]["l1"]["objects"] == 16
    assert alice["lookups"] == DOCS * len(rounds) and alice["hit_chunks"] == alice["lookup_chunks"]
    # The flood filled what Alice left free (a soft quota), then recycled its own bytes.
    assert flood["tiers"]["l1"]["objects"] == ARENA_OBJECTS - 16
    assert flood["tiers"]["l1"]["evictions"] == FLOOD_OBJECTS - (ARENA_OBJECTS - 16)
    assert flood["tiers"]["l1"]["quota_bytes"] == ARENA_OBJECTS * OBJECT // 2

    # The operator's view names both tenants by id, never by salt.
    assert main(["inspect", "summary", "--by-tenant", "--server", server.endpoint]) == 0
    out = capsys.readouterr().out
    assert tenant_label(ALICE) in out and tenant_label(FLOOD) in out and "salt" not in out
    assert "l1 evictions" in out and "100.0%" in out

    # And /metrics exports the same figures per tenant.
    text = render({"tenants": top(stats["tenants"], 10)})
    assert f'tiercache_tenant_evictions_total{{tenant="{tenant_label(FLOOD)}",tier="l1"}} 272.0' in text
    assert f'tiercache_tenant_evictions_total{{tenant="{tenant_label(ALICE)}",tier="l1"}} 0.0' in text
    assert (
        f'tiercache_tenant_lookup_chunks_total{{outcome="miss",tenant="{tenant_label(ALICE)}"}} 0.0' in text
    )


def test_the_disk_tier_keeps_quotas_too_and_each_object_keeps_its_tenant_on_the_way_down(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(
        l1_bytes=1024 * OBJECT,  # L1 holds everything: only the disk is short of room
        disk_path=str(tmp_path / "lmdb"),
        disk_budget=ARENA_OBJECTS * OBJECT,
        disk_options={"tenant_share": 0.5},
    )
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        run_flood(client, group)

        def written() -> bool:
            puts = client.stats()["tenants"]
            return sum(t["tiers"].get("disk", {}).get("puts", 0) for t in puts.values()) == 16 + FLOOD_OBJECTS

        wait_until(written, timeout=60, what="the write-through of every object to disk")
        disk = {label: t["tiers"]["disk"] for label, t in client.stats()["tenants"].items()}
    alice, flood = disk[tenant_label(ALICE)], disk[tenant_label(FLOOD)]
    assert alice["evictions"] == 0 and alice["objects"] == 16
    assert flood["evictions"] > FLOOD_OBJECTS - ARENA_OBJECTS
    assert flood["objects"] + flood["evictions"] == FLOOD_OBJECTS


def test_without_quotas_the_same_flood_evicts_the_other_tenant(start_server: StartServer) -> None:
    server = start_server(l1_bytes=ARENA_OBJECTS * OBJECT)
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        rounds, stats = run_flood(client, group)
    assert rounds[-1] == 0.0  # the control: plain LRU lets the flood push Alice out
    assert stats["tenants"][tenant_label(ALICE)]["tiers"]["l1"]["evictions"] == 16


def test_a_malformed_tenant_id_is_refused_and_the_server_keeps_serving(start_server: StartServer) -> None:
    from tiercache.errors import ServerError
    from tiercache.wire import protocol as p

    server = start_server()
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        key = keys_of(group, prompt_hashes(1))[0]
        with pytest.raises(ServerError, match="tenant id is 8 bytes"):
            client._call(p.Reserve(items=[(key.to_bytes(), OBJECT)], tenants=[b"abc"]))
        with pytest.raises(ServerError, match="1 items but 2 tenants"):
            client._call(p.Reserve(items=[(key.to_bytes(), OBJECT)], tenants=[ALICE, ALICE]))
        assert client.store_chunks([key], [os.urandom(OBJECT)], tenant=ALICE) == 1


def test_metrics_name_a_bounded_set_of_tenants_and_sum_the_rest() -> None:
    tenants = {
        f"{i:016x}": {"tiers": {"l1": {"bytes": i, "objects": 1, "evictions": 1}}, "lookups": 1}
        for i in range(1, 6)
    }
    named: set[str] = set()
    shown = top(tenants, 2, named)
    assert set(shown) == {f"{5:016x}", f"{4:016x}", "other"}
    assert shown["other"]["tiers"]["l1"] == {"bytes": 1 + 2 + 3, "objects": 3, "evictions": 3}
    assert shown["other"]["lookups"] == 3
    # Sticky: a tenant that grows past the named ones does not take their places.
    tenants[f"{1:016x}"]["tiers"]["l1"]["bytes"] = 100
    assert set(top(tenants, 2, named)) == {f"{5:016x}", f"{4:016x}", "other"}
