"""Specification: a tail object (one block past a request's last full chunk, keyed by
:func:`tiercache.keys.tail_hashes`) damaged at rest on the disk is a miss, as every object is: the
connector's tail lookup (``every_object``) restores the blocks before it and none after, every byte
of those right, and the server counts the failed verification and drops the object.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import lmdb

from tests.server.conftest import CHUNK, StartServer, manifest
from tiercache.keys import ExtraKeys, Fingerprint, ObjectKey, PrefixHasher, tail_hashes
from tiercache.testing.poll import wait_until
from tiercache.wire import protocol as p
from tiercache.wire.client import Client, LookupResult

BLOCK = 16  # the manifest's kernel block size
TAIL_BLOCKS = 3
DAMAGED = 1  # the second tail block


def block_payload(key: ObjectKey) -> bytes:
    """One block's object, named by its key: any mix-up of bytes shows."""
    return key.prefix_hash * 256  # 4 KiB


def tail_lookup(client: Client, hashes: list[bytes], group: p.GroupRef) -> LookupResult:
    """The connector's tail lookup: every object of the blocks asked for, prefetched."""
    req = client.lookup_async(hashes, [group], every_object=True)
    deadline = time.monotonic() + 10
    while (found := client.poll(req, 0.05)) is None:
        assert time.monotonic() < deadline, "no reply to the tail lookup"
    if found.pending:
        found = client.wait_ticket(found.ticket)
    return found  # type: ignore[no-any-return]


def test_a_damaged_tail_block_on_disk_is_a_miss_and_the_hit_ends_before_it(
    start_server: StartServer, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    rng = random.Random(3)
    tokens = [rng.randrange(3, 512) for _ in range(TAIL_BLOCKS * BLOCK)]  # a prompt shorter than a chunk
    hashes = tail_hashes(PrefixHasher(CHUNK, ExtraKeys()).before(0), tokens, BLOCK)
    node = start_server(disk_path=str(disk))
    with node.client() as client:
        [group] = client.register([(0, manifest())])
        keys = [ObjectKey(Fingerprint(group.fingerprint), group.object_group, h) for h in hashes]
        client.store_chunks(keys, [block_payload(k) for k in keys])
        wait_until(lambda: client.stats()["engine"]["l2_writes"] == len(keys), what="the tails on disk")
    node.stop()  # L1 gone; the tails are on the disk only

    env = lmdb.open(str(disk), max_dbs=8, map_size=1 << 30)
    data = env.open_db(b"data")
    with env.begin(write=True) as txn:
        k = keys[DAMAGED].to_bytes()
        value = bytearray(txn.get(k, db=data))
        value[len(value) // 2] ^= 0x10
        txn.put(k, bytes(value), db=data)
    env.close()

    node = start_server(disk_path=str(disk))
    with node.client() as client:
        [group] = client.register([(0, manifest())])
        found = tail_lookup(client, hashes, group)
        assert found.state is p.TicketStateName.READY
        assert found.ready_chunks == DAMAGED, "the hit ends at the damaged block"
        copies = client.read_ticket(found)
        assert copies == {k: block_payload(k) for k in keys[:DAMAGED]}
        disk_stats = client.stats()["tiers"]["disk"]
        assert disk_stats["verify_failures"] == 1
        # Dropped: asked again, the damaged block and the ones after it stay misses.
        again = tail_lookup(client, hashes, group)
        assert again.ready_chunks == DAMAGED
        client.read_ticket(again)
