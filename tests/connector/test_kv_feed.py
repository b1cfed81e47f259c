"""Specification: with ``kv_events_endpoint`` and ``kv_events_replay_endpoint`` set, the connector
publishes its tier events on a feed of its own, framed as vLLM frames its events, and a router that
starts or restarts gets a snapshot of every block and medium the tiers hold, numbered, then the
batches after it with no gap and no duplicate: its fold equals what the node's tiers hold.

A real server process, vLLM's own ``Request`` and block hasher, the connector's tracker and feed
driven as vLLM's engine loop drives them (``take`` every step), and a router subscriber
(:class:`~tiercache.testing.feed_follower.FeedFollower`), in this process or in its own, killed
mid-stream."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import msgspec
from vllm.distributed.kv_events import BlockStored, KVEventBatch
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from tests.connector.test_kv_events import BLOCK, CHUNK, PER, vllm_request
from tests.server.conftest import manifest
from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.client.client import Client
from tiercache.config.connector import ConnectorSettings
from tiercache.connector.events import TIER_MEDIA, KVEventTracker
from tiercache.connector.feed import FeedEndpoints, HoldingsFeed
from tiercache.errors import ConfigError
from tiercache.keys import Fingerprint, ObjectKey, chunk_hashes
from tiercache.testing.feed_follower import FeedFollower
from tiercache.testing.poll import wait_until

ROOT = Path(__file__).resolve().parents[2]
OBJECT = 16 << 10  # bytes per stored object
Pairs = set[tuple[str, Any]]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    """L1 holds 64 objects, so a stream of stores evicts from it (removals); the disk keeps all."""
    proc = ServerProcess(
        ServerSpec(
            listen=f"ipc://{tmp_path}/server.sock",
            l1_bytes=64 * OBJECT,
            disk_path=str(tmp_path / "lmdb"),
            options={"chunk_size": CHUNK},
        )
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


class Node:
    """One engine's connector side: its tracker and feed, stepped as vLLM's engine loop steps them,
    and every chunk it stored (key → the block hashes vLLM publishes for it)."""

    def __init__(self, server: ServerProcess, where: Path, buffer_batches: int = 10_000, chunks: int = 16384):
        self.client = Client(server.endpoint, timeout=5)
        [group] = self.client.register([(0, manifest())])
        self.fingerprint = Fingerprint(group.fingerprint)
        self.endpoints = FeedEndpoints(
            f"ipc://{where}/feed.sock", f"ipc://{where}/replay.sock", "", buffer_batches
        )
        settings = ConnectorSettings(
            kv_events_interval_s=0.01,
            kv_events_chunks=chunks,
            kv_events_endpoint=self.endpoints.endpoint,
            kv_events_replay_endpoint=self.endpoints.replay_endpoint,
        )
        self.tracker = KVEventTracker(settings, BLOCK)
        self.feed = HoldingsFeed(self.endpoints, self.tracker.holdings, self.tracker.lock)
        self.tracker.publish_to(self.feed.publish)
        self.tracker.use_anchor(self.fingerprint, 0)
        self.tracker.on_connect(self.client)
        self.stored: dict[bytes, list[Any]] = {}  # in the order stored
        self._next_token = 1000

    def close(self) -> None:
        self.feed.close()
        self.client.close()

    def store(self, chunks: int) -> None:
        """A new request of ``chunks`` full chunks, stored as the connector stores them."""
        tokens = list(range(self._next_token, self._next_token + chunks * CHUNK + 1))
        self._next_token += len(tokens)
        request = vllm_request(tokens)
        hashes = chunk_hashes(tokens, CHUNK)[:chunks]
        keys = [ObjectKey(self.fingerprint, 0, h) for h in hashes]
        for c, h in enumerate(hashes):
            self.tracker.remember(request, c, CHUNK, h)
            blocks = [maybe_convert_block_hash(b) for b in request.block_hashes[c * PER : (c + 1) * PER]]
            self.stored[keys[c].to_bytes()] = blocks
        assert self.client.store_chunks(keys, [os.urandom(OBJECT) for _ in keys]) == len(keys)

    def step(self) -> None:
        assert self.tracker.take(self.client) == []  # with a feed, nothing goes into vLLM's stream

    def published(self) -> Pairs:
        """What the feed's batches say is held now (the tracker's view, under its lock)."""
        with self.tracker.lock:
            holdings = self.tracker.holdings()
        return {(e.medium, h) for batch in holdings.events(1000) for e in batch for h in e.block_hashes}

    def on_server(self, followed: int) -> Pairs:
        """What the server's tiers hold of the last ``followed`` chunks stored, as (medium, block)."""
        recent = set(list(self.stored)[-followed:])
        pairs: Pairs = set()
        for tier in ("l1", "disk"):
            cursor = b""
            while True:
                page, cursor = self.client.list_keys(tier=tier, cursor=cursor, limit=1000)
                for listed in page:
                    if listed.key in recent:
                        pairs.update((TIER_MEDIA[tier], h) for h in self.stored[listed.key])
                if not cursor:
                    break
        return pairs


class Engine(threading.Thread):
    """The engine loop: ``stores`` requests of two chunks, one per step, then steps until stopped."""

    def __init__(self, node: Node, stores: int) -> None:
        super().__init__(name="engine-loop", daemon=True)
        self.node, self.stores = node, stores
        self.done_storing = threading.Event()
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for _ in range(self.stores):
                self.node.store(2)
                self.node.step()
                time.sleep(0.005)
            self.done_storing.set()
            while not self.halt.wait(0.01):
                self.node.step()
        except BaseException as exc:  # reported by the test, which joins this thread
            self.error = exc
            self.done_storing.set()


def test_a_routers_snapshot_is_what_the_tiers_hold_in_vllms_own_framing(
    server: ServerProcess, tmp_path: Path
) -> None:
    node = Node(server, tmp_path)
    try:
        for _ in range(40):
            node.store(2)  # 80 chunks: L1 (64 objects) evicts some, the disk keeps all
        wait_until(
            lambda: node.step() or node.published() == node.on_server(80),
            timeout=20,
            what="the tracker to read every change",
        )
        follower = FeedFollower(node.endpoints.endpoint, node.endpoints.replay_endpoint)
        try:
            follower.start()
            assert follower.fold.as_pairs() == node.on_server(80)
            held = follower.fold.held
            assert len(held["DISK"]) == 80 * PER and 0 < len(held["CPU"]) < 80 * PER
        finally:
            follower.close()

        # Every message of the snapshot decodes with vLLM's own batch type.
        import zmq

        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(node.endpoints.replay_endpoint)
        dealer.send_multipart((b"", b"snapshot"))
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        stored = 0
        while True:
            _, _topic, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            batch = decoder.decode(payload)
            assert all(isinstance(e, BlockStored) and e.block_size == BLOCK for e in batch.events)
            stored += sum(len(e.block_hashes) for e in batch.events)
        dealer.close(linger=0)
        ctx.term()
        assert stored == len(node.on_server(80))
    finally:
        node.close()


def test_a_router_resuming_behind_the_replay_buffer_takes_a_new_snapshot(
    server: ServerProcess, tmp_path: Path
) -> None:
    node = Node(server, tmp_path, buffer_batches=2)
    try:
        first = FeedFollower(node.endpoints.endpoint, node.endpoints.replay_endpoint)
        first.start()
        saved = first.fold  # what a router keeps when it goes down
        first.close()
        for _ in range(30):  # batches published while no router listens
            node.store(1)
            node.step()
            time.sleep(0.01)
        wait_until(lambda: node.feed.counts["batches"] > saved.next_seq + 2, timeout=20, what="more batches")
        follower = FeedFollower(node.endpoints.endpoint, node.endpoints.replay_endpoint)
        try:
            follower.resume(saved)
            assert follower.fold.snapshots == 2  # the buffer no longer reached back: a new snapshot

            def agreed() -> bool:
                node.step()
                follower.pump(0.05)
                return follower.fold.as_pairs() == node.published() == node.on_server(30)

            wait_until(agreed, timeout=30, what="the follower to agree with the tiers")
        finally:
            follower.close()
    finally:
        node.close()


def _follower(node: Node) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.connector.feed_follower_run",
            node.endpoints.endpoint,
            node.endpoints.replay_endpoint,
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _dump(proc: subprocess.Popen[str]) -> dict[str, Any]:
    import json

    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("dump\n")
    proc.stdin.flush()
    return dict(json.loads(proc.stdout.readline()))


def test_a_router_killed_and_restarted_mid_stream_ends_with_the_nodes_holdings(
    server: ServerProcess, tmp_path: Path
) -> None:
    # The tracker follows the last 200 chunks: older ones are retracted (removed) as they go.
    node = Node(server, tmp_path, chunks=200)
    engine = Engine(node, stores=300)
    first = second = None
    try:
        engine.start()
        first = _follower(node)
        while len(node.stored) < 150:  # mid-stream: L1 evicting, the tracker retracting
            time.sleep(0.02)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        second = _follower(node)  # restarted while the engine still stores
        restarted_at = len(node.stored)
        assert engine.done_storing.wait(timeout=120) and engine.error is None
        assert restarted_at < 600  # it did restart mid-stream (600: every chunk stored)

        latest: dict[str, Any] = {}

        def agreed() -> bool:
            latest.update(_dump(second))
            router = {(m, h) for m, h in latest["pairs"]}
            return router == node.published() == node.on_server(200)

        wait_until(agreed, timeout=60, interval=0.2, what="the restarted router to fold the node's holdings")
        held = node.on_server(200)
        assert {m for m, _ in held} == {"CPU", "DISK"} and len(held) > 200 * PER
        # Each live batch after its snapshot applied once, in order: no gap, no duplicate.
        applied = latest["applied"]
        assert applied and applied == list(range(applied[0], latest["next_seq"]))
        assert latest["snapshots"] == 1
        print(
            f"FIGURES router-restart: stores=600 chunks, restarted after {restarted_at}, batches "
            f"applied after the snapshot={len(applied)} (seq {applied[0]}..{applied[-1]}), live duplicates "
            f"skipped={latest['skipped']}, feed batches={node.feed.counts['batches']}, held pairs={len(held)}"
        )
    finally:
        engine.halt.set()
        engine.join(timeout=10)
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        node.close()


def test_the_feed_needs_both_endpoints_and_a_free_address() -> None:
    with pytest.raises(ConfigError, match="kv_events_endpoint and kv_events_replay_endpoint together"):
        ConnectorSettings(kv_events_endpoint="tcp://127.0.0.1:5560")
    settings = ConnectorSettings.from_extra_config(
        {"kv_events_endpoint": "tcp://127.0.0.1:5560", "kv_events_replay_endpoint": "tcp://127.0.0.1:5561"}
    )
    assert (settings.kv_events_endpoint, settings.kv_events_buffer_batches) == (
        "tcp://127.0.0.1:5560",
        10_000,
    )

    import zmq

    ctx = zmq.Context()
    squatter = ctx.socket(zmq.PUB)
    port = squatter.bind_to_random_port("tcp://127.0.0.1")
    try:
        tracker = KVEventTracker(ConnectorSettings(), BLOCK)
        endpoints = FeedEndpoints(f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:0")
        with pytest.raises(ConfigError, match="choose a free address for kv_events_endpoint"):
            HoldingsFeed(endpoints, tracker.holdings, tracker.lock)
    finally:
        squatter.close(linger=0)
        ctx.term()
