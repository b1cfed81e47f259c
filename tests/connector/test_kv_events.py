"""Specification: the connector publishes, as vLLM KV events, which tiers of its server hold the
chunks its engine stored (``BlockStored`` per tier it lands in, ``BlockRemoved`` when a tier drops
it), with the block hashes, token ids and extra keys vLLM itself would publish for those blocks.

A real server process and vLLM's own ``Request`` (with vLLM's block hasher); the end-to-end case
through vLLM's OpenAI server and its ZMQ publisher is ``tests/e2e/test_kv_events.py``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request

import tiercache.connector.events as events_module
from tests.server.conftest import manifest
from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.config.connector import ConnectorSettings
from tiercache.connector.events import KVEventTracker
from tiercache.keys import Fingerprint, ObjectKey, chunk_hashes
from tiercache.testing.poll import wait_until
from tiercache.wire.client import Client

CHUNK = 256  # the test server's chunk size (tests/server/conftest.py)
BLOCK = 16
MiB = 1 << 20


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        ServerSpec(
            listen=f"ipc://{tmp_path}/server.sock",
            disk_path=str(tmp_path / "lmdb"),
            options={"chunk_size": CHUNK},
        )
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def published(request: Request) -> list[Any]:
    """The request's block hashes as vLLM publishes them (64-bit ints by default)."""
    return [maybe_convert_block_hash(h) for h in request.block_hashes]


def vllm_request(tokens: list[int], salt: str | None = None) -> Request:
    init_none_hash(sha256_cbor)
    return Request(
        "r1",
        tokens,
        SamplingParams(max_tokens=1),
        None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(BLOCK, sha256_cbor),
    )


class Engine:
    """One engine's view: its tracker, its client and the keys of its stored chunks."""

    def __init__(self, server: ServerProcess, **settings: Any) -> None:
        self.client = Client(server.endpoint, timeout=5)
        [self.group] = self.client.register([(0, manifest())])
        self.fingerprint = Fingerprint(self.group.fingerprint)
        self.tracker = KVEventTracker(ConnectorSettings(kv_events_interval_s=0.01, **settings), BLOCK)
        self.tracker.use_anchor(self.fingerprint, 0)
        self.tracker.on_connect(self.client)

    def store(self, request: Request, chunks: int) -> list[ObjectKey]:
        hashes = chunk_hashes(request.prompt_token_ids, CHUNK)[:chunks]
        keys = [ObjectKey(self.fingerprint, 0, h) for h in hashes]
        for c, h in enumerate(hashes):
            self.tracker.remember(request, c, CHUNK, h)
        assert self.client.store_chunks(keys, [os.urandom(4096) for _ in keys]) == len(keys)
        return keys

    def events(self, until: int) -> list[Any]:
        """Events gathered until at least ``until`` have come."""
        got: list[Any] = []

        def enough() -> bool:
            got.extend(self.tracker.take(self.client))
            return len(got) >= until

        wait_until(enough, timeout=10, what=f"{until} KV events")
        return got


def test_a_stored_chunk_is_published_per_tier_with_the_blocks_vllm_would_publish(
    server: ServerProcess,
) -> None:
    engine = Engine(server)
    tokens = list(range(1000, 1000 + 3 * CHUNK + 10))
    request = vllm_request(tokens)
    engine.store(request, 3)
    events = engine.events(until=6)  # 3 chunks x (L1, then disk by write-through)
    assert all(isinstance(e, BlockStored) for e in events)
    by_medium: dict[str, list[BlockStored]] = {}
    for e in events:
        by_medium.setdefault(e.medium, []).append(e)
    assert sorted(by_medium) == ["CPU", "DISK"]
    per = CHUNK // BLOCK
    for stored in by_medium.values():
        stored.sort(key=lambda e: tokens.index(e.token_ids[0]))
        assert [e.block_hashes for e in stored] == [
            published(request)[c * per : (c + 1) * per] for c in range(3)
        ]
        assert [e.token_ids for e in stored] == [tokens[c * CHUNK : (c + 1) * CHUNK] for c in range(3)]
        assert stored[0].parent_block_hash is None
        assert stored[1].parent_block_hash == published(request)[per - 1]
        assert {e.block_size for e in stored} == {BLOCK}
        assert {e.locality for e in stored} == {"LOCAL"}

    # A router hashing like vLLM finds the same hashes from the events' token ids alone.
    parent = None
    for e in by_medium["CPU"]:
        assert e.parent_block_hash == (None if parent is None else maybe_convert_block_hash(parent))
        for i, h in enumerate(e.block_hashes):
            parent = hash_block_tokens(sha256_cbor, parent, e.token_ids[i * BLOCK : (i + 1) * BLOCK], None)
            assert maybe_convert_block_hash(parent) == h


def test_the_cache_salt_travels_as_vllm_publishes_it(server: ServerProcess) -> None:
    engine = Engine(server)
    request = vllm_request(list(range(5, 5 + CHUNK + 1)), salt="tenant-a")
    engine.store(request, 1)
    stored = [e for e in engine.events(until=1) if e.medium == "CPU"]
    [event] = stored
    assert event.extra_keys[0] == ("tenant-a",)  # untagged, on the first block only, like vLLM's own
    assert all(k is None for k in event.extra_keys[1:])


def test_a_tier_that_drops_a_chunk_publishes_its_removal(server: ServerProcess) -> None:
    engine = Engine(server)
    request = vllm_request(list(range(7, 7 + 2 * CHUNK + 1)))
    keys = engine.store(request, 2)
    engine.events(until=4)
    assert engine.client.delete(keys[0]) == 2  # from L1 and from disk
    removed = engine.events(until=2)
    assert all(isinstance(e, BlockRemoved) for e in removed)
    assert sorted(e.medium for e in removed) == ["CPU", "DISK"]
    assert all(e.block_hashes == published(request)[: CHUNK // BLOCK] for e in removed)


def test_chunks_beyond_the_bound_are_retracted_not_left_stale(server: ServerProcess) -> None:
    engine = Engine(server, kv_events_chunks=1)
    first = vllm_request(list(range(11, 11 + CHUNK + 1)))
    engine.store(first, 1)
    engine.events(until=2)
    second = vllm_request(list(range(4000, 4000 + CHUNK + 1)))
    engine.store(second, 1)  # the first chunk is forgotten: a router must not keep it on our word
    events = engine.events(until=4)
    retracted = [e for e in events if isinstance(e, BlockRemoved)]
    assert sorted(e.medium for e in retracted) == ["CPU", "DISK"]
    assert all(e.block_hashes == published(first)[: CHUNK // BLOCK] for e in retracted)
    assert engine.tracker.counts["retracted_chunks"] == 1


def test_a_restarted_server_retracts_what_its_memory_held(tmp_path: Path, server: ServerProcess) -> None:
    engine = Engine(server)
    engine.store(vllm_request(list(range(50, 50 + CHUNK + 1))), 1)
    engine.events(until=2)
    other = ServerProcess(ServerSpec(listen=f"ipc://{tmp_path}/other.sock", options={"chunk_size": CHUNK}))
    try:
        other.wait_ready()
        with Client(other.endpoint, timeout=5) as moved:
            engine.tracker.on_connect(moved)  # as after a reconnect to a new server instance
            [event] = engine.events(until=1)
        assert isinstance(event, BlockRemoved) and event.medium == "CPU"  # the disk copy is still there
    finally:
        other.stop()


def test_no_events_are_published_while_vllm_publishes_none(server: ServerProcess) -> None:
    tracker = KVEventTracker(ConnectorSettings(kv_events_interval_s=0), BLOCK)
    with Client(server.endpoint, timeout=5) as client:
        tracker.on_connect(client)
        tracker.remember(vllm_request(list(range(CHUNK + 1))), 0, CHUNK, bytes(16))
        assert tracker.take(client) == []


def test_the_engine_keeps_stepping_until_its_stores_are_reported(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM collects take_events() only while its engine steps: the connector reports pending work
    # (has_pending_push_work) from a store's planning until a tier reports the chunk.
    engine = Engine(server)
    request = vllm_request(list(range(90, 90 + CHUNK + 1)))
    assert not engine.tracker.busy()
    engine.store(request, 1)
    assert engine.tracker.busy()
    engine.events(until=1)
    assert not engine.tracker.busy()
    # A store the server dropped is never reported: it stops holding the engine after a while.
    monkeypatch.setattr(events_module, "CONFIRM_WITHIN_S", 0.0)
    engine.tracker.remember(vllm_request(list(range(7000, 7000 + CHUNK + 1))), 0, CHUNK, bytes(16))
    assert not engine.tracker.busy()
