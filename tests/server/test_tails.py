"""Specification: over the real server, a tail lookup (``LookupKind.TAIL``: the tail hashes of the
blocks of one chunk) answers with the one stored object holding the longest prefix of them,
whatever its key: a tail of exactly those blocks, a longer tail, or the full chunk, as each object's
reservation named the blocks it holds (``Reserve.holds``). A tail still being stored is waited
for; an object no tier holds any more is never the answer; blocks nobody named are a miss."""

from __future__ import annotations

import os
from pathlib import Path

from tests.server.conftest import CHUNK, StartServer, manifest
from tiercache.client.client import Client
from tiercache.config import DiskConfig
from tiercache.engine.engine import BLOCK_INDEX_STATE
from tiercache.keys import ExtraKeys, Fingerprint, ObjectKey, PrefixHasher, chunk_hashes, tail_hashes
from tiercache.keys.digest import digest
from tiercache.l2_disk import DiskTier
from tiercache.wire import protocol as p

BLOCK = 16
BLOCK_BYTES = 4096
TOKENS = list(range(1000, 1000 + CHUNK))  # one chunk's tokens
HASHES = tail_hashes(PrefixHasher(CHUNK, ExtraKeys()).before(0), TOKENS[: 4 * BLOCK], BLOCK)
CHUNK_HASH = chunk_hashes(TOKENS, CHUNK)[0]


def key(group: p.GroupRef, prefix_hash: bytes) -> ObjectKey:
    return ObjectKey(Fingerprint(group.fingerprint), group.object_group, prefix_hash)


def reserve(
    client: Client, group: p.GroupRef, prefix_hash: bytes, holds: list[bytes]
) -> tuple[p.Slot, bytes]:
    """Reserve and fill (not commit) an object of ``len(holds)`` blocks holding ``holds``."""
    data = os.urandom(BLOCK_BYTES * len(holds))
    [slot] = client.reserve([(key(group, prefix_hash), len(data))], holds=[(prefix_hash, holds)])
    client.arena().view(slot.offset, slot.nbytes)[:] = data
    return slot, data


def store(client: Client, group: p.GroupRef, prefix_hash: bytes, holds: list[bytes]) -> bytes:
    slot, data = reserve(client, group, prefix_hash, holds)
    assert client.commit([slot.token], [digest(data)]) == 1
    return data


def tail(client: Client, group: p.GroupRef, asked: list[bytes], **kw: object) -> p.LookupReply:
    return client.lookup(asked, [group], kind=p.LookupKind.TAIL, **kw)  # type: ignore[arg-type]


def test_the_blocks_of_a_stored_chunk_are_found_by_a_prompt_that_cannot_name_it(
    start_server: StartServer,
) -> None:
    server = start_server()
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        whole = store(client, group, CHUNK_HASH, HASHES[: CHUNK // BLOCK - 1])  # (15 blocks named)
        found = tail(client, group, HASHES[:3])
        assert (found.state, found.blocks, found.chunks, found.ready_chunks) == (
            p.TicketStateName.READY,
            3,
            1,
            1,
        )
        assert client.read_ticket(found) == {key(group, CHUNK_HASH): whole}
        assert client.stats()["engine"]["tail_blocks_hit"] == 3


def test_the_longest_prefix_wins_and_the_newest_object_holding_it(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        one = store(client, group, HASHES[0], HASHES[:1])
        two = store(client, group, HASHES[1], HASHES[:2])
        found = tail(client, group, HASHES)  # 4 blocks asked, 2 held
        assert found.blocks == 2
        assert client.read_ticket(found) == {key(group, HASHES[1]): two}
        # A prompt of one block: both objects hold it; the newest answers.
        found = tail(client, group, HASHES[:1])
        assert found.blocks == 1
        assert client.read_ticket(found) == {key(group, HASHES[1]): two}
        assert one  # (stored, superseded by nothing: still a candidate behind the newer one)


def test_blocks_nobody_named_are_a_miss_and_so_is_an_object_no_tier_holds(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        assert tail(client, group, HASHES).blocks == 0
        store(client, group, HASHES[1], HASHES[:2])
        assert client.delete(key(group, HASHES[1])) >= 1
        assert tail(client, group, HASHES).blocks == 0


def test_another_layout_never_finds_the_object(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        [other] = client.register([(0, manifest(kv_dtype="float16"))])
        store(client, group, HASHES[1], HASHES[:2])
        assert tail(client, other, HASHES).blocks == 0


def test_a_tail_lookup_waits_for_a_tail_still_being_stored(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as producer, server.client() as consumer:
        [group] = producer.register([(0, manifest())])
        consumer.register([(0, manifest())])
        slot, data = reserve(producer, group, HASHES[2], HASHES[:3])  # a prefill engine's, in flight
        found = tail(consumer, group, HASHES[:2], inflight_wait_s=30)  # a prompt one block shorter
        assert (found.state, found.blocks, found.awaiting) == (p.TicketStateName.PENDING, 2, 1)
        producer.commit([slot.token], [digest(data)])
        ready = consumer.wait_ticket(found.ticket, timeout=30)
        assert (ready.state, ready.blocks, ready.chunks, ready.ready_chunks) == (
            p.TicketStateName.READY,
            2,
            1,
            1,
        )
        assert consumer.read_ticket(ready) == {key(group, HASHES[2]): data}


def test_a_committed_object_drops_the_shorter_tails_it_supersedes(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        store(client, group, HASHES[0], HASHES[:1])
        slot, data = reserve(client, group, CHUNK_HASH, HASHES[: CHUNK // BLOCK - 1])
        assert (
            client.commit([slot.token], [digest(data)], supersedes=[key(group, h) for h in HASHES[:3]]) == 1
        )
        assert client.get(key(group, HASHES[0])) is None
        assert client.stats()["engine"]["tails_superseded"] == 1
        found = tail(client, group, HASHES[:1])
        assert client.read_ticket(found) == {key(group, CHUNK_HASH): data}


def test_hashes_of_the_wrong_length_in_holds_are_refused(start_server: StartServer) -> None:
    import pytest

    from tiercache.errors import ServerError

    server = start_server()
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        with pytest.raises(ServerError, match="16 bytes"):
            client.reserve([(key(group, HASHES[0]), BLOCK_BYTES)], holds=[(HASHES[0], [b"short"])])


def test_a_server_restarted_on_its_disk_finds_the_blocks_inside_a_stored_chunk_again(
    start_server: StartServer, tmp_path: Path
) -> None:
    """The block index is kept on the disk tier at a clean stop and read back at start: a prompt
    that cannot name the chunk holding its blocks hits it from disk after the restart."""
    disk = str(tmp_path / "lmdb")
    first = start_server(disk_path=disk)
    with first.client() as client:
        [group] = client.register([(0, manifest())])
        whole = store(client, group, CHUNK_HASH, HASHES)  # the chunk names its first blocks
    assert first.stop() == 0
    second = start_server(disk_path=disk)
    with second.client() as client:
        [group] = client.register([(0, manifest())])
        assert client.stats()["engine"]["tail_index_blocks"] == len(HASHES)
        found = tail(client, group, HASHES[:3])
        assert found.blocks == 3 and found.per_tier == {"disk": 1}
        ready = client.wait_ticket(found.ticket) if found.pending else found
        assert client.read_ticket(ready) == {key(group, CHUNK_HASH): whole}


def test_a_damaged_block_index_on_disk_is_ignored_and_the_server_starts_without_it(
    start_server: StartServer, tmp_path: Path
) -> None:
    disk = tmp_path / "lmdb"
    first = start_server(disk_path=str(disk))
    with first.client() as client:
        [group] = client.register([(0, manifest())])
        store(client, group, CHUNK_HASH, HASHES)
    assert first.stop() == 0
    with DiskTier(DiskConfig(path=disk)) as tier:
        kept = tier.get_state(BLOCK_INDEX_STATE)
        assert kept is not None
        assert tier.put_state(BLOCK_INDEX_STATE, kept[:-3])  # truncated
    second = start_server(disk_path=str(disk))
    with second.client() as client:
        [group] = client.register([(0, manifest())])
        assert client.stats()["engine"]["tail_index_blocks"] == 0
        assert tail(client, group, HASHES[:3]).blocks == 0  # a miss, never a guess
        assert client.lookup([CHUNK_HASH], [group], prefetch=False).chunks == 1  # the chunk is there
