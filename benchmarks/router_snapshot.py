"""Benchmark the connector's feed: how long a (re)starting router waits for a snapshot of what a
node's tiers hold, and how long the engine loop waits for it (not run in CI).

Builds a connector's event tracker holding ``--blocks`` blocks (chunks of 16 blocks of 16 tokens,
hashed by vLLM's own block hasher, each in ``--media`` media, as a server's residency log reports
them), publishes them through the feed (:mod:`tiercache.connector.feed`) over ipc, and then asks
for a snapshot ``--repeat`` times with the reference router
(:class:`~tiercache.testing.feed_follower.FeedFollower`). It prints, per snapshot:

* ``snapshot_s``: from the request until the router's fold holds every block (the feed building
  and encoding the ``BlockStored`` batches, ZMQ, the router decoding and folding them);
* ``engine_wait_ms``: how long the snapshot held the tracker's lock (the engine loop's wait);
* the floor measured in the same run: building the same ``BlockStored`` batches, encoding them and
  decoding them as the router does, one after the other on one thread (no sockets, no fold), and
  ``snapshot_s`` against it (below 1: the feed's and the router's halves overlap).

Usage (needs vLLM, e.g. the project's ``.venv-vllm``)::

    python benchmarks/router_snapshot.py [--blocks 1000000] [--media 1] [--repeat 3]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec
from vllm import SamplingParams
from vllm.distributed.kv_events import KVEventBatch
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from tiercache.config.connector import ConnectorSettings
from tiercache.connector.events import KVEventTracker
from tiercache.connector.feed import SNAPSHOT_BATCH, FeedEndpoints, HoldingsFeed
from tiercache.keys import Fingerprint, ObjectKey
from tiercache.testing.feed_follower import Batch, FeedFollower
from tiercache.wire import protocol as p

BLOCK = 16
PER = 16  # blocks per chunk
CHUNK = BLOCK * PER
TIERS = ("l1", "disk", "s3")


class ScriptedLog:
    """Stands in for the server's residency log: one reply saying every object landed in each tier."""

    def __init__(self, keys: list[bytes], tiers: tuple[str, ...]) -> None:
        changes = [(tier, key) for tier in tiers for key in keys]
        events = [p.ResidencyEvent(seq, p.EventKind.STORED, t, k) for seq, (t, k) in enumerate(changes, 1)]
        self._reply: p.EventsReply | None = p.EventsReply(
            instance=b"bench", next_seq=len(events), events=events, local_tiers=list(tiers)
        )

    def events(
        self,
        since: int = -1,
        fingerprints: Sequence[Fingerprint] = (),
        limit: int = 10_000,
        timeout: float | None = None,
    ) -> p.EventsReply:
        return p.EventsReply(instance=b"bench", next_seq=0)

    def events_async(
        self, since: int = -1, fingerprints: Sequence[Fingerprint] = (), limit: int = 10_000
    ) -> int:
        return 1

    def poll(self, req_id: int, wait_s: float = 0.0) -> p.EventsReply | None:
        reply, self._reply = self._reply, None
        return reply or p.EventsReply(instance=b"bench", next_seq=req_id)


def build(chunks: int, tracker: KVEventTracker, fingerprint: Fingerprint) -> list[bytes]:
    """Remember ``chunks`` chunks of 1-chunk requests (vLLM's hashes), their anchor keys."""
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(BLOCK, sha256_cbor)
    keys = []
    for c in range(chunks):
        tokens = list(range(c * CHUNK, (c + 1) * CHUNK + 1))
        request = Request(f"r{c}", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)
        prefix = c.to_bytes(16, "big")
        tracker.remember(request, 0, CHUNK, prefix)
        keys.append(ObjectKey(fingerprint, 0, prefix).to_bytes())
    return keys


def floor_s(holdings: Any) -> float:
    """Encode and decode the snapshot's batches, nothing else: what no snapshot can beat."""
    encode, decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder(Batch).decode
    began = time.perf_counter()
    for events in holdings.events(SNAPSHOT_BATCH):
        decode(encode(KVEventBatch(ts=0.0, events=events)))
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=1_000_000, help="blocks held (default 1,000,000)")
    parser.add_argument("--media", type=int, default=1, choices=(1, 2, 3), help="media each block is in")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    chunks = args.blocks // PER
    fingerprint = Fingerprint(bytes(16))
    with tempfile.TemporaryDirectory() as where:
        endpoints = FeedEndpoints(f"ipc://{where}/feed.sock", f"ipc://{where}/replay.sock")
        settings = ConnectorSettings(
            kv_events_interval_s=1e-6,
            kv_events_chunks=chunks,
            kv_events_endpoint=endpoints.endpoint,
            kv_events_replay_endpoint=endpoints.replay_endpoint,
        )
        tracker = KVEventTracker(settings, BLOCK)
        tracker.use_anchor(fingerprint, 0)
        began = time.perf_counter()
        keys = build(chunks, tracker, fingerprint)
        log = ScriptedLog(keys, TIERS[: args.media])
        tracker.on_connect(log)  # type: ignore[arg-type]  # the log stands in for a client
        feed = HoldingsFeed(endpoints, tracker.holdings, tracker.lock)
        tracker.publish_to(feed.publish)
        while tracker.take(log) or feed.counts["batches"] == 0:  # type: ignore[arg-type]
            time.sleep(0.01)
        print(
            f"tracker: {chunks:,} chunks x {PER} blocks x {args.media} media = {chunks * PER * args.media:,} "
            f"(block, medium) pairs, built in {time.perf_counter() - began:.1f} s; "
            f"max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
        )
        with tracker.lock:
            holdings = tracker.holdings()
        floors, took, waits = [], [], []
        for _ in range(args.repeat):
            floors.append(floor_s(holdings))
            follower = FeedFollower(endpoints.endpoint, endpoints.replay_endpoint, timeout_s=60)
            try:
                started = time.perf_counter()
                follower.start()
                took.append(time.perf_counter() - started)
                held = len(follower.fold.as_pairs())
            finally:
                follower.close()
            assert held == chunks * PER * args.media, held
            waits.append(feed.last_lock_s * 1000)
            print(
                f"snapshot: {held:,} pairs in {took[-1]:.2f} s (engine loop waited {waits[-1]:.1f} ms); "
                f"floor (build + encode + decode, one thread) {floors[-1]:.2f} s; ratio {took[-1] / floors[-1]:.2f}x"
            )
        feed.close()
        print(
            f"median of {args.repeat}: snapshot {statistics.median(took):.2f} s, engine wait "
            f"{statistics.median(waits):.1f} ms, floor {statistics.median(floors):.2f} s, ratio "
            f"{statistics.median(took) / statistics.median(floors):.2f}x"
        )


if __name__ == "__main__":
    main()
