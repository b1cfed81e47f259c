"""Specification: a tail object (the first blocks of a chunk a request did not fill, keyed by the
tail hash of its last block: :func:`tiercache.keys.tail_hashes`) damaged at rest on the disk is a
miss, as every object is: the connector's tail lookup (``LookupKind.TAIL``) that meets it loads
nothing, the server counts the failed verification and drops the object, and asked again the hit
is what remains intact (here an older, shorter tail of the same chunk), every byte of it right.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import lmdb

from tests.server.conftest import CHUNK, StartServer, manifest
from tiercache.client.client import Client, LookupResult
from tiercache.keys import ExtraKeys, Fingerprint, ObjectKey, PrefixHasher, tail_hashes
from tiercache.keys.digest import digest
from tiercache.testing.poll import wait_until
from tiercache.wire import protocol as p

BLOCK = 16  # the manifest's kernel block size
BLOCK_BYTES = 4096


def tail_payload(key: ObjectKey, blocks: int) -> bytes:
    """A tail object of ``blocks`` blocks, named by its key: any mix-up of bytes shows."""
    return key.prefix_hash * (BLOCK_BYTES * blocks // 16)


def store_tail(client: Client, key: ObjectKey, holds: list[bytes]) -> None:
    """Store one tail object holding the blocks ``holds`` (as the connector's worker does)."""
    payload = tail_payload(key, len(holds))
    [slot] = client.reserve([(key, len(payload))], holds=[(key.prefix_hash, holds)])
    client.arena().view(slot.offset, slot.nbytes)[:] = payload
    assert client.commit([slot.token], [digest(payload)]) == 1


def tail_lookup(client: Client, hashes: list[bytes], group: p.GroupRef) -> LookupResult:
    """The connector's tail lookup: the object holding most of these blocks, prefetched."""
    req = client.lookup_async(hashes, [group], kind=p.LookupKind.TAIL)
    deadline = time.monotonic() + 10
    while (found := client.poll(req, 0.05)) is None:
        assert time.monotonic() < deadline, "no reply to the tail lookup"
    if found.pending:
        found = client.wait_ticket(found.ticket)
    return found  # type: ignore[no-any-return]


def test_a_damaged_tail_on_disk_is_a_miss_and_an_intact_shorter_one_is_found_after(
    start_server: StartServer, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    rng = random.Random(3)
    tokens = [rng.randrange(3, 512) for _ in range(3 * BLOCK)]  # three blocks of a chunk, no more
    hashes = tail_hashes(PrefixHasher(CHUNK, ExtraKeys()).before(0), tokens, BLOCK)
    node = start_server(disk_path=str(disk))
    with node.client() as client:
        [group] = client.register([(0, manifest())])
        fingerprint = Fingerprint(group.fingerprint)
        short, long = (ObjectKey(fingerprint, group.object_group, h) for h in (hashes[0], hashes[2]))
        store_tail(client, short, hashes[:1])  # one request's tail of one block
        store_tail(client, long, hashes)  # another's of three, the same blocks first
        wait_until(lambda: client.stats()["engine"]["l2_writes"] == 2, what="both tails on disk")
        assert client.clear_batch(100, tier="l1") == 2  # on the disk only now

        env = lmdb.open(str(disk), max_dbs=8, map_size=1 << 30)  # beside the running server
        data = env.open_db(b"data")
        with env.begin(write=True) as txn:
            value = bytearray(txn.get(long.to_bytes(), db=data))
            value[len(value) // 2] ^= 0x10
            txn.put(long.to_bytes(), bytes(value), db=data)
        env.close()

        found = tail_lookup(client, hashes, group)
        assert found.state is p.TicketStateName.MISS and not found.ready_chunks, (
            "the damaged tail is never loaded"
        )
        client.release_ticket(found.ticket)
        assert client.stats()["tiers"]["disk"]["verify_failures"] == 1
        # Dropped: asked again, the intact one-block tail is the hit, byte for byte.
        again = tail_lookup(client, hashes, group)
        assert again.state is p.TicketStateName.READY
        assert (again.blocks, again.chunks, again.ready_chunks) == (1, 1, 1)
        assert client.read_ticket(again) == {short: tail_payload(short, 1)}
        assert client.stats()["tiers"]["disk"]["verify_failures"] == 1
