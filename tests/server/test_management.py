"""Specification: explain, list keys, stats and clear tell an operator what the cache holds and why."""

from __future__ import annotations

from tests.server.conftest import StartServer, manifest
from tests.server.test_data_path import prompt_hashes, store_prompt
from tiercache.keys import Fingerprint, ObjectKey

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


def test_list_keys_pages_with_a_cursor_and_filters(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as client:
        a, b = client.register([(0, manifest())]) + client.register([(0, manifest(model_revision="r2"))])
        store_prompt(client, a, prompt_hashes(7), nbytes=4 * KiB)
        store_prompt(client, b, prompt_hashes(2, seed=3), nbytes=4 * KiB)

        seen: list[bytes] = []
        cursor = b""
        while True:
            page, cursor = client.list_keys(fingerprint=Fingerprint(a.fingerprint), limit=3, cursor=cursor)
            assert len(page) <= 3
            seen += [k.key for k in page]
            if not cursor:
                break
        assert len(seen) == 7 == len(set(seen)) and seen == sorted(seen)
        assert all(ObjectKey.from_bytes(k).fingerprint.raw == a.fingerprint for k in seen)
        everything, cursor = client.list_keys(tier="l1")
        assert len(everything) == 9 and cursor == b""
        assert all(k.tiers == ["l1"] for k in everything)


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
