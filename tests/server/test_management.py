"""Specification: explain, list keys, stats and clear tell an operator what the cache holds and why."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server.conftest import StartServer, manifest
from tests.server.test_data_path import prompt_hashes, store_prompt
from tiercache.client.client import Client
from tiercache.errors import ServerError
from tiercache.keys import Fingerprint, ObjectKey
from tiercache.testing.poll import wait_until

KiB = 1 << 10


def test_explain_says_where_each_chunk_is_or_why_not(start_server: StartServer) -> None:
    server = start_server(l1_bytes=1024 * KiB)
    with server.client() as client:
        group, other = client.register([(0, manifest())]) + client.register([(0, manifest(kv_dtype="fp8"))])
        hashes = prompt_hashes(12)
        for h in hashes:  # one at a time: 12 x 128 KiB overflows the 1 MiB arena, evicting the oldest
            store_prompt(client, group, [h], nbytes=128 * KiB)

        entries = client.explain(hashes + prompt_hashes(1, seed=9), [group])
        statuses = [e.status for e in entries]
        assert statuses[0] == "evicted"
        assert (entries[0].tier, entries[0].reason) == ("l1", "capacity")
        assert statuses[-2] == "l1"
        assert statuses[-1] == "never_stored"

        [under_other] = client.explain(hashes[-1:], [other])
        assert under_other.status == "other_fingerprint"
        assert under_other.other_fingerprint == group.fingerprint


def _two_fingerprints(client: Client) -> bytes:
    """Store 7 chunks under one fingerprint and 2 under another; the first fingerprint."""
    a, b = client.register([(0, manifest())]) + client.register([(0, manifest(model_revision="r2"))])
    store_prompt(client, a, prompt_hashes(7), nbytes=4 * KiB)
    store_prompt(client, b, prompt_hashes(2, seed=3), nbytes=4 * KiB)
    return a.fingerprint


def _every_page(client: Client, **query: object) -> list[bytes]:
    """Page through ``list_keys(**query)`` 3 keys at a time; every key listed."""
    seen: list[bytes] = []
    cursor = b""
    while True:
        page, cursor = client.list_keys(limit=3, cursor=cursor, **query)  # type: ignore[arg-type]
        assert len(page) <= 3
        seen += [k.key for k in page]
        if not cursor:
            return seen


def test_list_keys_pages_with_a_cursor_and_filters(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as client:
        fp = _two_fingerprints(client)
        seen = _every_page(client, fingerprint=Fingerprint(fp))
        assert len(seen) == 7 == len(set(seen)) and seen == sorted(seen)
        assert all(ObjectKey.from_bytes(k).fingerprint.raw == fp for k in seen)
        everything, cursor = client.list_keys(tier="l1")
        assert len(everything) == 9 and cursor == b""
        assert all(k.tiers == ["l1"] for k in everything)


def test_list_keys_by_use_pages_one_tier_and_refuses_several(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as client:
        fp = _two_fingerprints(client)
        seen = _every_page(client, tier="l1", fingerprint=Fingerprint(fp), order="use")
        assert len(seen) == 7 == len(set(seen))
        assert all(ObjectKey.from_bytes(k).fingerprint.raw == fp for k in seen)
        with pytest.raises(ServerError, match="one tier"):
            client.list_keys(order="use")
        with pytest.raises(ServerError, match="unknown"):
            client.list_keys(tier="l1", order="newest")


def test_stats_report_engine_tier_and_server_counters(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        store_prompt(client, group, prompt_hashes(3), nbytes=4 * KiB)
        stats = client.stats()
        assert stats["engine"]["stores"] == 3
        assert stats["tiers"]["l1"]["objects"] == 3
        assert stats["server"]["clients"] >= 1
        assert "auth_secret" not in repr(stats)


def test_clear_by_fingerprint_and_all(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as client:
        a, b = client.register([(0, manifest())]) + client.register([(0, manifest(model_revision="r2"))])
        store_prompt(client, a, prompt_hashes(4), nbytes=4 * KiB)
        store_prompt(client, b, prompt_hashes(2, seed=5), nbytes=4 * KiB)
        assert client.clear(Fingerprint(a.fingerprint)) == 4
        assert client.lookup(prompt_hashes(4), [a], prefetch=False).chunks == 0
        assert client.lookup(prompt_hashes(2, seed=5), [b], prefetch=False).chunks == 2
        assert client.clear() == 2
        assert client.list_keys()[0] == []


def test_manifest_of_a_registered_fingerprint(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        assert client.manifest(Fingerprint(group.fingerprint)) == manifest()
        assert client.manifest(Fingerprint(b"\0" * 16)) is None


def test_register_rejects_a_chunk_size_that_does_not_match(start_server: StartServer) -> None:
    import pytest

    from tiercache.errors import ServerError

    server = start_server()
    with server.client() as client, pytest.raises(ServerError, match="chunk size 512"):
        client.register([(0, manifest(chunk_size=512))])


def wait_for_disk(client: Client, objects: int) -> None:
    """Poll until the write-through has put ``objects`` objects on disk (it runs in the background)."""
    wait_until(
        lambda: client.stats()["tiers"]["disk"]["objects"] >= objects, what="the write-through to disk"
    )


def test_clear_batch_deletes_at_most_its_limit_from_the_tier_named(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(disk_path=str(tmp_path / "disk"))
    with server.client() as client:
        a, b = client.register([(0, manifest())]) + client.register([(0, manifest(model_revision="r2"))])
        store_prompt(client, a, prompt_hashes(5), nbytes=4 * KiB)
        store_prompt(client, b, prompt_hashes(2, seed=5), nbytes=4 * KiB)
        fp_a = Fingerprint(a.fingerprint)
        wait_for_disk(client, 7)

        assert client.clear_batch(2, tier="l1", fingerprint=fp_a) == 2
        assert client.clear_batch(10, tier="l1", fingerprint=fp_a) == 3
        assert client.clear_batch(10, tier="l1", fingerprint=fp_a) == 0  # done: the signal to stop
        held = {ObjectKey.from_bytes(k.key).fingerprint.raw for k in client.list_keys(tier="l1")[0]}
        assert held == {b.fingerprint}  # the other fingerprint stays in L1
        assert client.lookup(prompt_hashes(5), [a], prefetch=False).per_tier == {
            "disk": 5
        }  # disk keeps its copies

        with pytest.raises(ServerError, match="no tier named 's3'; this server has l1, disk") as bad:
            client.clear_batch(10, tier="s3")
        assert bad.value.code == "invalid"
        with pytest.raises(ServerError, match="limit 0 is out of range"):
            client.clear_batch(0)


def test_warm_promotes_lower_tier_objects_into_l1_within_its_byte_budget(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(disk_path=str(tmp_path / "disk"))
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        data = store_prompt(client, group, prompt_hashes(6), nbytes=4 * KiB)
        keys = list(data)
        wait_for_disk(client, 6)
        while client.clear_batch(100, tier="l1"):
            pass

        first = client.warm(keys[:4], max_bytes=8 * KiB)  # stops once 8 KiB are promoted
        assert (first.promoted, first.bytes, first.present, first.failed) == (2, 8 * KiB, 0, 0)
        stranger = ObjectKey(Fingerprint(group.fingerprint), 0, prompt_hashes(1, seed=9)[0])
        rest = client.warm([*keys, stranger])
        assert (rest.promoted, rest.present, rest.failed) == (4, 2, 1)  # the stranger is nowhere
        assert client.load_chunks(keys) == [data[k] for k in keys]  # verified copies, all in L1 now
