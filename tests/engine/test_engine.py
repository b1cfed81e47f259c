"""The tiered engine: longest restorable prefix, promotion, write-through and write-back."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest

from tests.conftest import S3Endpoint, payload_for
from tests.engine.conftest import EngineFactory, MiB, disk_tier, l1_tier, s3_tier
from tiercache.config import EngineConfig, L3WritePolicy
from tiercache.engine import GroupSpec, TicketState, TieredEngine
from tiercache.errors import TierError
from tiercache.keys import Fingerprint, GroupKind, chunk_hashes
from tiercache.keys.tenant import tenant_id, tenant_label
from tiercache.testing.faults import FaultInjectingTier, FaultPlan

CHUNK_BYTES = 64 * 1024
FP = Fingerprint(b"A" * 16)
FULL = GroupSpec(0, GroupKind.FULL_ATTENTION, FP)


def prompt(n_chunks: int, salt: int = 0) -> list[bytes]:
    return chunk_hashes([salt * 100_000 + t for t in range(n_chunks * 16)], 16)


def store(engine, groups, hashes, chunks=None, only=None) -> None:  # type: ignore[no-untyped-def]
    """Store every group's object for the given chunk indices (default: all)."""
    for i in range(len(hashes)) if chunks is None else chunks:
        for g in groups:
            if only is not None and g is not only:
                continue
            key = g.key(hashes[i])
            assert engine.put(key, payload_for(key, CHUNK_BYTES))


def load_all(engine, ticket) -> None:  # type: ignore[no-untyped-def]
    """Every pinned object holds exactly the bytes stored under its key."""
    assert ticket.handles, "the ticket pins nothing: no byte to check"
    for key, handle in ticket.handles.items():
        assert bytes(handle.buffer) == payload_for(key, CHUNK_BYTES)


# -- lookup -------------------------------------------------------------------------------------
def test_lookup_finds_the_longest_stored_prefix_in_l1(make_engine: EngineFactory) -> None:
    engine = make_engine(l1_tier())
    hashes = prompt(8)
    store(engine, [FULL], hashes, chunks=range(5))
    result = engine.lookup(hashes, [FULL])
    assert result.chunks == 5
    assert result.per_tier == {"l1": 5}


def test_a_hole_ends_the_prefix(make_engine: EngineFactory) -> None:
    engine = make_engine(l1_tier())
    hashes = prompt(6)
    store(engine, [FULL], hashes, chunks=[0, 1, 3, 4])
    assert engine.lookup(hashes, [FULL]).chunks == 2


def test_other_fingerprints_never_hit(make_engine: EngineFactory) -> None:
    engine = make_engine(l1_tier())
    hashes = prompt(4)
    store(engine, [FULL], hashes)
    other = GroupSpec(0, GroupKind.FULL_ATTENTION, Fingerprint(b"B" * 16))
    assert engine.lookup(hashes, [other]).chunks == 0


# -- hybrid models ------------------------------------------------------------------------------
SW = GroupSpec.sliding(1, FP, window_tokens=32, chunk_size=16)  # needs the 2 trailing chunks
REC = GroupSpec(2, GroupKind.RECURRENT, FP)


@pytest.mark.parametrize("group", [FULL, SW, REC, dataclasses.replace(SW, kind=GroupKind.FULL_ATTENTION)])
def test_a_groups_binary_keys_are_those_of_the_keys_it_needs(group: GroupSpec) -> None:
    hashes = prompt(6)
    for boundary in range(1, 7):
        assert group.needed_raw(hashes, boundary) == [k.raw for k in group.needed(hashes, boundary)]


def test_sliding_window_needs_only_its_trailing_chunks(make_engine: EngineFactory) -> None:
    engine = make_engine(l1_tier())
    hashes = prompt(6)
    store(engine, [FULL], hashes)
    store(engine, [SW], hashes, chunks=[4, 5])  # chunks 0..3 of the window group are gone
    assert engine.lookup(hashes, [FULL, SW]).chunks == 6


def test_sliding_window_with_a_hole_inside_the_window_falls_back(make_engine: EngineFactory) -> None:
    engine = make_engine(l1_tier())
    hashes = prompt(6)
    store(engine, [FULL], hashes)
    store(engine, [SW], hashes, chunks=[0, 1, 2, 3, 5])  # chunk 4 missing: boundaries 5, 6 fail
    assert engine.lookup(hashes, [FULL, SW]).chunks == 4


def test_recurrent_state_is_needed_exactly_at_the_boundary(make_engine: EngineFactory) -> None:
    engine = make_engine(l1_tier())
    hashes = prompt(6)
    store(engine, [FULL], hashes)
    store(engine, [REC], hashes, chunks=[1, 3])  # states after chunk 2 and after chunk 4
    result = engine.lookup(hashes, [FULL, REC])
    assert result.chunks == 4
    assert result.per_tier == {"l1": 5}  # 4 full-attention chunks + 1 state


def test_a_missing_group_means_no_hit_at_all(make_engine: EngineFactory) -> None:
    engine = make_engine(l1_tier())
    hashes = prompt(4)
    store(engine, [FULL], hashes)
    assert engine.lookup(hashes, [FULL, REC]).chunks == 0


def test_prefetch_pins_exactly_what_the_boundary_needs(make_engine: EngineFactory) -> None:
    engine = make_engine(l1_tier())
    hashes = prompt(6)
    groups = [FULL, SW, REC]
    store(engine, groups, hashes)
    ticket = engine.prefetch(hashes, groups, 4)
    assert engine.poll(ticket) is TicketState.READY
    assert ticket.chunks == 4
    assert set(ticket.handles) == {FULL.key(h) for h in hashes[:4]} | {
        SW.key(hashes[2]),
        SW.key(hashes[3]),
        REC.key(hashes[3]),
    }
    load_all(engine, ticket)
    engine.release_ticket(ticket)


def test_l1_answers_alone_only_when_it_holds_every_object_of_the_whole_chain(
    tmp_path: Path, make_engine: EngineFactory
) -> None:
    """``lookup_front`` is the lookup's own answer when L1 holds all of it, else ``None``: a hole,
    a group's missing object, or a chunk only on disk leaves it to the full lookup."""
    engine = make_engine(l1_tier(), disk_tier(tmp_path / "disk"))
    hashes = prompt(6)
    groups = [FULL, SW, REC]
    store(engine, groups, hashes)
    assert engine.flush(10.0)  # every object on disk too
    found = engine.lookup_front(hashes, groups)
    assert found is not None
    assert found == engine.lookup(hashes, groups)
    assert set(found.keys) == set(engine.prefetch(hashes, groups, 6).handles)
    assert found.per_tier == {"l1": 6 + 2 + 1}
    assert engine.lookup_front(hashes + prompt(1, salt=9), groups) is None  # the last chunk is nowhere
    engine.delete(SW.key(hashes[4]))  # a hole inside the sliding window of the last chunk
    assert engine.lookup_front(hashes, groups) is None
    assert engine.lookup(hashes, groups).chunks == 4
    engine.l1.delete(FULL.key(hashes[1]))  # on disk only: the full lookup finds it there
    assert engine.lookup_front(hashes[:3], [FULL]) is None
    assert engine.lookup(hashes[:3], [FULL]).per_tier == {"l1": 2, "disk": 1}


def test_l1_answers_a_tail_lookup_alone_only_for_no_candidate_or_a_best_candidate_it_holds(
    tmp_path: Path, make_engine: EngineFactory
) -> None:
    """``lookup_tail_front`` is the tail lookup's own answer when the block index and L1 give it:
    no object holds the first block, or the object holding the most blocks is committed in L1.
    A best candidate on disk only, or nowhere any more, leaves it to the full tail lookup."""
    engine = make_engine(l1_tier(), disk_tier(tmp_path / "disk"))
    chunk, tail = prompt(2, salt=1)  # two prefix hashes: the objects' keys
    blocks = prompt(4, salt=2)  # four block hashes of one chunk
    store(engine, [FULL], [chunk, tail])
    assert engine.flush(10.0)
    engine.index_blocks(tail, blocks[:2])  # a tail of the chunk's first two blocks
    engine.index_blocks(chunk, blocks)  # the whole chunk
    asked = blocks[:3]
    front = engine.lookup_tail_front(asked, [FULL])
    assert front is not None and (front.blocks, front.target) == (3, chunk)
    assert front == engine.lookup_tail(asked, [FULL])
    unknown = prompt(2, salt=3)  # blocks no object holds
    none = engine.lookup_tail_front(unknown, [FULL])
    assert none is not None and none.blocks == 0 and none == engine.lookup_tail(unknown, [FULL])
    engine.l1.delete(FULL.key(chunk))  # on disk only: the full lookup finds it there
    assert engine.lookup_tail_front(asked, [FULL]) is None
    assert engine.lookup_tail(asked, [FULL]).found.per_tier == {"disk": 1}
    engine.delete(FULL.key(chunk))  # nowhere, still named by the index
    assert engine.lookup_tail_front(asked, [FULL]) is None
    found = engine.lookup_tail(asked, [FULL])  # forgets it: the tail holds two of the blocks
    assert (found.blocks, found.target) == (2, tail)
    assert engine.lookup_tail_front(asked, [FULL]) == found


def test_a_prefetch_given_the_lookups_keys_pins_the_same_objects(make_engine: EngineFactory) -> None:
    engine = make_engine(l1_tier())
    hashes = prompt(5)
    groups = [FULL, SW, REC]
    store(engine, groups, hashes)
    found = engine.lookup_front(hashes, groups)
    assert found is not None
    given = engine.prefetch(hashes, groups, 5, keys=found.keys)
    built = engine.prefetch(hashes, groups, 5)
    assert engine.poll(given) is engine.poll(built) is TicketState.READY
    assert set(given.handles) == set(built.handles) and given.chunks == built.chunks == 5
    load_all(engine, given)
    engine.release_ticket(given)
    engine.release_ticket(built)


def test_a_prefetch_without_local_reads_holds_objects_all_in_l1_as_one_pin(
    make_engine: EngineFactory, tmp_path: Path
) -> None:
    """What the server asks (its clients read the slots, it reads nothing): all in L1, the ticket
    is READY at once and holds the objects as one pin, which its release ends; with one object on
    disk it pins object by object while that one is promoted, as any ticket."""
    l1 = l1_tier(1 * MiB)
    engine = make_engine(l1, disk_tier(tmp_path))
    hashes = prompt(4)
    store(engine, [FULL], hashes)
    ticket = engine.prefetch(hashes, [FULL], 4, local_reads=False)
    assert ticket.state is TicketState.READY and ticket.chunks == 4
    assert ticket.held is not None and ticket.held.count == 4 and not ticket.handles

    def churn(salt: int) -> None:  # twice L1's 16 chunks, each written to disk before the next
        for part in range(4):
            engine.flush()
            store(engine, [FULL], prompt(8, salt=salt * 10 + part))

    churn(1)
    assert all(l1.contains(FULL.key(h)) for h in hashes)  # held through the churn
    assert engine.release_ticket(ticket, read=True) == 0 and ticket.held is None
    churn(2)
    assert not any(l1.contains(FULL.key(h)) for h in hashes)  # released: evicted (kept on disk)

    promoted = engine.prefetch(hashes, [FULL], 4, local_reads=False)
    assert engine.wait(promoted, 10) is TicketState.READY and promoted.chunks == 4
    assert promoted.held is None and len(promoted.handles) == 4
    load_all(engine, promoted)
    engine.release_ticket(promoted)


def test_hold_front_answers_and_holds_a_hit_all_in_l1_in_one_pass_or_holds_nothing(
    make_engine: EngineFactory, tmp_path: Path
) -> None:
    """The server's usual lookup: every object in L1, the answer and a READY ticket holding them
    as one pin; anything less (a chunk only on disk, or none of the chain's end in L1) is ``None``
    with nothing held, for lookup_front and lookup to answer as before."""
    l1 = l1_tier(1 * MiB)
    engine = make_engine(l1, disk_tier(tmp_path))
    groups = [FULL, SW]
    hashes = prompt(4)
    store(engine, groups, hashes)
    before = engine.stats()["engine"]
    both = engine.hold_front(hashes, groups)
    assert both is not None
    found, ticket = both
    assert (found.chunks, found.per_tier) == (4, {"l1": 4 + SW.window_chunks})
    assert ticket.state is TicketState.READY and ticket.chunks == 4 and not ticket.handles
    assert ticket.held is not None and ticket.held.count == 4 + SW.window_chunks
    after = engine.stats()["engine"]
    assert after["lookups"] - before["lookups"] == 1
    assert after["lookup_chunks_hit"] - before["lookup_chunks_hit"] == 4
    assert engine.release_ticket(ticket) == 0
    assert engine.hold_front(prompt(4, salt=1), groups) is None  # stored nowhere
    engine.flush()
    assert l1.delete(FULL.key(hashes[1]))  # on disk only now
    assert engine.hold_front(hashes, groups) is None
    assert engine.lookup(hashes, groups).chunks == 4  # the disk still has it


def test_commit_many_commits_in_order_up_to_a_reservation_no_longer_open(make_engine: EngineFactory) -> None:
    """A store of many chunks commits in one call into L1; a reservation that ended meanwhile
    stops it there, those before it committed and counted, and the error says how many."""
    engine = make_engine(l1_tier())
    keys = [FULL.key(h) for h in prompt(3)]
    handles = engine.reserve_many([(k, CHUNK_BYTES) for k in keys])
    for key, handle in zip(keys, handles, strict=True):
        handle.buffer[:] = payload_for(key, CHUNK_BYTES)
    engine.abort(handles[1])
    before = engine.stats()["engine"]["stores"]
    with pytest.raises(TierError) as raised:
        engine.commit_many(handles, [None] * 3)
    assert getattr(raised.value, "committed", None) == 1
    assert engine.stats()["engine"]["stores"] - before == 1
    assert [engine.l1.contains(k) for k in keys] == [True, False, False]
    engine.abort(handles[2])


# -- lower tiers ---------------------------------------------------------------------------------
def restarted_on_disk(tmp_path: Path, make_engine: EngineFactory, hashes: list[bytes]) -> TieredEngine:
    """A fresh engine (empty L1) on the disk of a first one that stored ``hashes`` and closed."""
    first = make_engine(l1_tier(), disk_tier(tmp_path))
    store(first, [FULL], hashes)
    assert first.flush(timeout=30)
    first.close()
    return make_engine(l1_tier(), disk_tier(tmp_path))


def test_a_restart_finds_chunks_on_disk_and_promotes_them(tmp_path: Path, make_engine: EngineFactory) -> None:
    hashes = prompt(8)
    second = restarted_on_disk(tmp_path, make_engine, hashes)
    result = second.lookup(hashes, [FULL])
    assert result.chunks == 8
    assert result.per_tier == {"disk": 8}
    ticket = second.prefetch(hashes, [FULL], result.chunks)
    assert second.wait(ticket, timeout=30) is TicketState.READY
    assert ticket.chunks == 8
    load_all(second, ticket)
    second.release_ticket(ticket)
    # Promoted chunks are now L1 hits.
    assert second.lookup(hashes, [FULL]).per_tier == {"l1": 8}


def test_promoted_copies_count_against_the_asking_tenant(tmp_path: Path, make_engine: EngineFactory) -> None:
    hashes = prompt(4)
    second = restarted_on_disk(tmp_path, make_engine, hashes)
    tenant = tenant_id("acme")
    ticket = second.prefetch(hashes, [FULL], 4, tenant=tenant)
    assert second.wait(ticket, timeout=30) is TicketState.READY
    second.release_ticket(ticket)
    held = second.stats()["tenants"][tenant_label(tenant)]["tiers"]  # type: ignore[index]
    assert held["l1"]["objects"] == 4 and held["l1"]["bytes"] == 4 * CHUNK_BYTES


def test_a_second_node_reads_through_s3(tmp_path: Path, s3: S3Endpoint, make_engine: EngineFactory) -> None:
    hashes = prompt(6)
    node_a = make_engine(l1_tier(), disk_tier(tmp_path / "a"), s3_tier(s3))
    store(node_a, [FULL], hashes)
    assert node_a.flush(timeout=30)
    assert node_a.stats()["engine"]["l3_writes"] == 6  # type: ignore[index]
    disk = node_a.stats()["tiers"]["disk"]  # type: ignore[index]
    assert (disk["hits"], disk["misses"]) == (0, 0)  # reading L2 as the S3 write's source serves no reader

    node_b = make_engine(l1_tier(), disk_tier(tmp_path / "b"), s3_tier(s3))
    result = node_b.lookup(hashes, [FULL])
    assert result.chunks == 6
    assert result.per_tier == {"s3": 6}
    ticket = node_b.prefetch(hashes, [FULL], 6)
    assert node_b.wait(ticket, timeout=30) is TicketState.READY
    assert ticket.chunks == 6 and set(ticket.handles) == {FULL.key(h) for h in hashes}
    load_all(node_b, ticket)
    node_b.release_ticket(ticket)


@pytest.mark.parametrize("wrapped", [False, True], ids=["disk", "disk behind a wrapper"])
def test_write_back_sends_chunks_to_s3_when_disk_evicts_them(
    tmp_path: Path, s3: S3Endpoint, make_engine: EngineFactory, wrapped: bool
) -> None:
    """Also when the disk tier is wrapped (fault injection, metrics): the wrapper hands the
    engine's listener to the disk tier instead of dropping it."""
    disk = disk_tier(tmp_path, budget=8 * CHUNK_BYTES)
    l2 = FaultInjectingTier(disk, FaultPlan()) if wrapped else disk
    l3 = s3_tier(s3)
    engine = make_engine(l1_tier(32 * MiB), l2, l3, l3_write_policy=L3WritePolicy.BACK)
    hashes = prompt(32)
    store(engine, [FULL], hashes)
    assert engine.flush(timeout=60)
    assert engine.flush(timeout=60)  # evictions during the first drain queue more S3 writes
    assert engine.stats()["engine"]["l3_writes"] > 0  # type: ignore[index]
    on_s3 = set(l3.iter_keys())
    on_disk = set(l2.iter_keys())
    # Every chunk is still somewhere below L1, and S3 got only what the disk let go.
    assert {FULL.key(h) for h in hashes} <= on_s3 | on_disk
    assert on_s3 and len(on_s3) < len(hashes)


def test_write_back_from_a_tier_that_cannot_hand_over_evictions_is_refused_at_start(s3: S3Endpoint) -> None:
    """Never silently: an engine whose write-back could never write refuses to be built."""
    front, middle, l3 = l1_tier(), l1_tier(), s3_tier(s3)
    try:
        with pytest.raises(TierError, match="cannot hand evicted objects"):
            TieredEngine(front, [middle, l3], EngineConfig(l3_write_policy=L3WritePolicy.BACK))
    finally:
        for tier in (front, middle, l3):
            tier.close()


def flip_byte_in_file(path: Path, needle: bytes) -> None:
    """Flip one byte of the first occurrence of ``needle`` in a file (bit rot on disk)."""
    data = bytearray(path.read_bytes())
    at = data.find(needle)
    assert at >= 0, "payload not found in the file"
    data[at + len(needle) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupt_disk_object_is_a_counted_miss_never_wrong_bytes(
    tmp_path: Path, make_engine: EngineFactory
) -> None:
    hashes = prompt(4)
    first = make_engine(l1_tier(), disk_tier(tmp_path))
    store(first, [FULL], hashes)
    assert first.flush(timeout=30)
    first.close()
    victim = FULL.key(hashes[2])
    flip_byte_in_file(tmp_path / "data.mdb", payload_for(victim, CHUNK_BYTES)[:4096])

    second = make_engine(l1_tier(), disk_tier(tmp_path))
    ticket = second.prefetch(hashes, [FULL], 4)
    assert second.wait(ticket, timeout=30) is TicketState.READY
    assert ticket.chunks == 2  # chunk 2 failed verification, so chunk 3 is not restorable either
    load_all(second, ticket)
    second.release_ticket(ticket)
    disk_stats = second.stats()["tiers"]["disk"]  # type: ignore[index]
    assert disk_stats["verify_failures"] == 1
    assert second.lookup(hashes, [FULL]).chunks == 2  # the corrupt object was deleted


# -- bounded queues and owed copies -------------------------------------------------------------
def test_l1_never_evicts_a_chunk_still_owed_to_disk(tmp_path: Path, make_engine: EngineFactory) -> None:
    gate = threading.Event()
    slow_disk = FaultInjectingTier(disk_tier(tmp_path), FaultPlan(write_gate=gate))
    engine = make_engine(l1_tier(4 * CHUNK_BYTES), slow_disk, write_queue_depth=64)
    hashes = prompt(8)
    stored = [engine.put(FULL.key(h), payload_for(FULL.key(h), CHUNK_BYTES)) for h in hashes]
    # L1 holds 4 chunks; with the disk stalled none may be evicted, so later stores are dropped.
    assert stored[:4] == [True] * 4
    assert not any(stored[4:])
    assert engine.stats()["engine"]["stores_dropped"] == 4  # type: ignore[index]
    gate.set()
    assert engine.flush(timeout=30)
    # Once written through, L1 may evict them again and new stores succeed.
    assert engine.put(FULL.key(prompt(1, salt=9)[0]), b"x" * CHUNK_BYTES)
    assert engine.lookup(hashes[:4], [FULL]).chunks == 4


def test_a_full_write_queue_drops_and_counts(tmp_path: Path, make_engine: EngineFactory) -> None:
    gate = threading.Event()
    slow_disk = FaultInjectingTier(disk_tier(tmp_path), FaultPlan(write_gate=gate))
    engine = make_engine(l1_tier(), slow_disk, write_queue_depth=2, write_workers=1)
    hashes = prompt(10)
    store(engine, [FULL], hashes)  # never blocks even though the disk is stalled
    drops = engine.stats()["engine"]["l2_queue_drops"]  # type: ignore[index]
    assert drops >= 10 - 2 - 1  # queue depth 2 plus the one the writer holds
    gate.set()
    assert engine.flush(timeout=30)


def test_a_failing_disk_is_counted_and_reads_still_come_from_l1(
    tmp_path: Path, make_engine: EngineFactory
) -> None:
    broken = FaultInjectingTier(disk_tier(tmp_path), FaultPlan(fail_writes=True))
    engine = make_engine(l1_tier(), broken)
    hashes = prompt(3)
    store(engine, [FULL], hashes)
    assert engine.flush(timeout=30)
    assert engine.stats()["engine"]["write_failures"] == 3  # type: ignore[index]
    assert engine.lookup(hashes, [FULL]).chunks == 3


def test_manifests_are_kept_on_disk_for_inspection(tmp_path: Path, make_engine: EngineFactory) -> None:
    from tests.keys.test_object_key import manifest

    m = manifest()
    engine = make_engine(l1_tier(), disk_tier(tmp_path))
    fp = engine.register_manifest(m)
    engine.close()
    again = make_engine(l1_tier(), disk_tier(tmp_path))
    assert again.manifest(fp) == m
