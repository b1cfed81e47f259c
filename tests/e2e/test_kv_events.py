"""KV events for routers, end to end: vLLM's OpenAI server with ``--kv-events-config`` (its ZMQ
publisher) and the connector, and a subscriber that decodes with vLLM's own event classes only.

The claims: after a prompt is served, the stream carries ``BlockStored`` with tiercache's medium
(``CPU``: its L1) for exactly the prompt's full chunks, beside vLLM's own ``GPU`` events; the block
hashes equal the ones vLLM publishes for the same blocks, and a router recomputing vLLM's hashes from
the events' token ids finds them; once the server has evicted those chunks (an L1 of 15 objects, no
lower tier) the stream carries ``BlockRemoved`` for the same hashes and medium.

With ``tails`` on (a second engine and server, chunk 128, L1 and disk): a prompt's tail is
announced, one ``BlockStored`` per medium with the hashes vLLM publishes for its blocks; a
second turn that fills the chunk supersedes it (the server drops them from L1 and disk), and a
router folding the stream still holds every block of both chunks in ``CPU`` and ``DISK``, never
having been told a ``CPU`` block went.

With a feed of tiercache's own (``kv_events_endpoint``, a third engine and server): vLLM's stream
carries only vLLM's ``GPU`` blocks; a router that starts after a prompt was served learns its chunks
from the feed's snapshot, then follows L1's evictions live; a router started later gets in its
snapshot exactly what the first one folded.

Three vLLM server starts (~40 s each). vLLM blocks 32; chunk 64 tokens (one object of 64 KiB), then 128.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("vllm")

import msgspec
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash, maybe_convert_block_hash

from tests.e2e.engine_run import make_prompts, write_served_tiny_llama
from tests.e2e.openai_server import OpenAIServer, api_server_argv, tiny_model_flags
from tests.e2e.setup import engine_stats
from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.testing.checkpoints import token_text
from tiercache.testing.feed_follower import FeedFollower
from tiercache.testing.poll import wait_until

pytestmark = pytest.mark.e2e

MiB = 1 << 20
CHUNK = 64
BLOCK = 32
FIRST = 200  # tokens: 3 full chunks, 6 full blocks


@dataclass
class Subscriber:
    """Collects every event vLLM publishes on ``endpoint`` (a background thread)."""

    endpoint: str
    events: list[Any] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        with zmq.Context() as ctx, ctx.socket(zmq.SUB) as sock:
            sock.connect(self.endpoint)
            sock.setsockopt(zmq.SUBSCRIBE, b"kv")
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                _topic, _seq, payload = sock.recv_multipart()
                batch = decoder.decode(payload)
                with self._lock:
                    self.events.extend(batch.events)

    def of(self, kind: type, medium: str) -> list[Any]:
        with self._lock:
            return [e for e in self.events if isinstance(e, kind) and e.medium == medium]

    def all(self) -> list[Any]:
        with self._lock:
            return list(self.events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@dataclass
class Stack:
    server: ServerProcess
    engine: OpenAIServer
    events: Subscriber
    prompts: list[list[int]]


@contextmanager
def serving(tmp: Any, server: ServerSpec, prompts: list[list[int]], **connector: Any) -> Iterator[Stack]:
    """A tiercache server of ``server``, a vLLM OpenAI server with the connector (``connector``:
    more of its settings) and vLLM's ZMQ publisher, and a subscriber to that."""
    model = tmp / "model"
    write_served_tiny_llama(model, seed=4321)
    proc = ServerProcess(server)
    proc.wait_ready()
    # An ipc endpoint, not a TCP port picked now: vLLM binds it only after its start-up, and in
    # between another engine (the other CI shard's) may take a port picked free here.
    endpoint = f"ipc://{tmp}/kv-events.sock"
    transfer = {
        "kv_connector": "TierCacheConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"server": proc.endpoint, "kv_events_interval_s": 0.2, **connector},
    }
    publisher = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "topic": "kv",
    }
    engine = OpenAIServer(
        api_server_argv(
            model,
            *tiny_model_flags(256),
            f"--kv-transfer-config={json.dumps(transfer)}",
            f"--kv-events-config={json.dumps(publisher)}",
        ),
        tmp / "vllm.log",
    )
    events = Subscriber(endpoint)
    try:
        engine.wait_ready()
        yield Stack(proc, engine, events, prompts)
    finally:
        events.close()
        engine.stop()
        proc.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("kv-events")
    # L1 only, room for 15 objects: later prompts evict the first one's chunks from every tier.
    server = ServerSpec(listen=f"ipc://{tmp}/server.sock", l1_bytes=1 * MiB, options={"chunk_size": CHUNK})
    with serving(tmp, server, make_prompts([FIRST] + [190] * 8, seed=23)) as s:
        yield s


def blocks_of(events: list[Any]) -> list[Any]:
    return [h for e in events for h in e.block_hashes]


def test_stored_chunks_are_published_with_vllms_own_block_hashes_and_removed_once_evicted(
    stack: Stack,
) -> None:
    first = stack.prompts[0]
    stack.engine.complete(token_text(first), 2)
    full_blocks = FIRST // CHUNK * CHUNK // BLOCK  # the blocks of the full chunks: 6

    wait_until(
        lambda: len(blocks_of(stack.events.of(BlockStored, "CPU"))) >= full_blocks,
        timeout=60,
        what="tiercache's BlockStored",
    )
    stored = stack.events.of(BlockStored, "CPU")
    assert len(stored) == FIRST // CHUNK  # one event per chunk, for exactly the full chunks
    assert [e.token_ids for e in stored] == [
        first[c * CHUNK : (c + 1) * CHUNK] for c in range(FIRST // CHUNK)
    ]
    assert {e.block_size for e in stored} == {BLOCK}

    # The same hashes as vLLM's own events for those blocks (medium GPU)...
    gpu = blocks_of(stack.events.of(BlockStored, "GPU"))
    assert blocks_of(stored) == gpu[:full_blocks]
    # ...and as a router recomputes them from the token ids, with the engine's hash (vLLM's default,
    # --prefix-caching-hash-algo sha256).
    sha256 = get_hash_fn_by_name("sha256")
    init_none_hash(sha256)
    parent = None
    for e in stored:
        assert e.parent_block_hash == (None if parent is None else maybe_convert_block_hash(parent))
        for i, h in enumerate(e.block_hashes):
            parent = hash_block_tokens(sha256, parent, e.token_ids[i * BLOCK : (i + 1) * BLOCK], None)
            assert maybe_convert_block_hash(parent) == h

    # 8 more prompts (24 chunks) through an L1 of 15 objects: the first prompt's chunks are evicted.
    for prompt in stack.prompts[1:]:
        stack.engine.complete(token_text(prompt), 2)
    wanted = set(blocks_of(stored))

    def removed() -> set[Any]:
        return wanted & set(blocks_of(stack.events.of(BlockRemoved, "CPU")))

    wait_until(lambda: removed() == wanted, timeout=60, what="BlockRemoved for the evicted chunks")
    with stack.server.client() as client:
        assert client.stats()["tiers"]["l1"]["evictions"].get("capacity", 0) >= FIRST // CHUNK


# -- tails -------------------------------------------------------------------------------------

TAIL_CHUNK = 128  # 4 blocks: a chunk's tails are its first 3
TURN1 = TAIL_CHUNK + 3 * BLOCK + 10  # 234 tokens: chunk 0, then 3 full blocks of chunk 1 (its tails)
TIERCACHE = ("CPU", "DISK")


def fold(events: list[Any]) -> set[tuple[str, Any]]:
    """What a router folding ``events`` believes this replica holds: (medium, block hash)."""
    held: set[tuple[str, Any]] = set()
    for e in events:
        if isinstance(e, BlockStored):
            held.update((e.medium, h) for h in e.block_hashes)
        elif isinstance(e, BlockRemoved):
            held.difference_update((e.medium, h) for h in e.block_hashes)
    return held


@pytest.fixture(scope="module")
def tails_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("kv-events-tails")
    server = ServerSpec(
        listen=f"ipc://{tmp}/server.sock",
        l1_bytes=64 * MiB,
        disk_path=str(tmp / "lmdb"),
        options={"chunk_size": TAIL_CHUNK},
    )
    turn1, marker = make_prompts([TURN1, TAIL_CHUNK + 12], seed=29)
    turn2 = turn1 + make_prompts([TAIL_CHUNK - TURN1 % TAIL_CHUNK + 8], seed=31)[0]  # fills chunk 1
    with serving(tmp, server, [turn1, turn2, marker], tails=True) as s:
        yield s


def test_tails_are_announced_and_a_router_still_holds_every_block_once_their_chunk_supersedes_them(
    tails_stack: Stack,
) -> None:
    stack = tails_stack
    turn1, turn2, marker = stack.prompts
    per = TAIL_CHUNK // BLOCK
    stack.engine.complete(token_text(turn1), 2)

    def gpu_hashes(prompt: list[int], blocks: int) -> list[Any]:
        """vLLM's own hashes of the prompt's first ``blocks`` blocks, from its GPU events."""
        by_tokens = {
            tuple(e.token_ids[i * BLOCK : (i + 1) * BLOCK]): h
            for e in stack.events.of(BlockStored, "GPU")
            for i, h in enumerate(e.block_hashes)
        }
        return [by_tokens.get(tuple(prompt[i * BLOCK : (i + 1) * BLOCK])) for i in range(blocks)]

    # Turn 1: chunk 0 (4 blocks) and a tail of chunk 1's first 3 blocks, each announced in L1 and on disk.
    turn1_blocks = TURN1 // BLOCK
    wait_until(
        lambda: (
            {(m, h) for m in TIERCACHE for h in gpu_hashes(turn1, turn1_blocks)} <= fold(stack.events.all())
        ),
        timeout=60,
        what="BlockStored for turn 1's chunk and tails in CPU and DISK",
    )
    hashes = gpu_hashes(turn1, turn1_blocks)
    # The tail is one object of chunk 1's 3 full blocks: one event (per medium) with their hashes.
    tails = [e for e in stack.events.of(BlockStored, "CPU") if e.block_hashes[0] == hashes[per]]
    assert [e.block_hashes for e in tails] == [hashes[per:turn1_blocks]]
    assert [e.token_ids for e in tails] == [turn1[per * BLOCK : turn1_blocks * BLOCK]]
    assert [e.parent_block_hash for e in tails] == [hashes[per - 1]]
    # A router recomputes each tail's hash from its parent and token ids, as vLLM hashes.
    sha256 = get_hash_fn_by_name("sha256")
    init_none_hash(sha256)
    parent = None
    for i in range(turn1_blocks):
        parent = hash_block_tokens(sha256, parent, turn1[i * BLOCK : (i + 1) * BLOCK], None)
        assert maybe_convert_block_hash(parent) == hashes[i]
    before = engine_stats(stack.server)["tails_superseded"]

    # Turn 2 fills chunk 1: its commit supersedes the tail (dropped from L1 and disk).
    stack.engine.complete(token_text(turn2), 2)
    wait_until(
        lambda: engine_stats(stack.server)["tails_superseded"] - before == 2 * len(tails),
        timeout=60,
        what="the tails superseded from L1 and disk",
    )

    # A later prompt's chunk: once its CPU event comes, the tracker has read past the supersession.
    # Short prompts keep the engine stepping (vLLM collects events only then) until chunk 1's disk
    # copy is announced too.
    def settled() -> bool:
        stack.engine.complete(token_text(marker[:8]), 16)
        chunk1 = gpu_hashes(turn2, 2 * per)[per:]
        cpu = {h for e in stack.events.of(BlockStored, "CPU") for h in e.block_hashes}
        on_disk = [e.block_hashes for e in stack.events.of(BlockStored, "DISK")]
        return set(gpu_hashes(marker, per)) <= cpu and chunk1 in on_disk

    stack.engine.complete(token_text(marker), 2)
    wait_until(settled, timeout=60, what="the marker's CPU events and chunk 1's DISK event")
    wanted = {(m, h) for m in TIERCACHE for h in gpu_hashes(turn2, 2 * per)}
    events = stack.events.all()
    ours = [e for e in events if getattr(e, "medium", None) in TIERCACHE]
    removed = {
        m: [h for e in ours if isinstance(e, BlockRemoved) and e.medium == m for h in e.block_hashes]
        for m in TIERCACHE
    }
    print(
        f"\n[e2e kv events tails] tiercache events {len(ours)}: BlockStored "
        f"{sum(isinstance(e, BlockStored) for e in ours)} ({len(tails)} tail in CPU), BlockRemoved blocks "
        f"CPU {len(removed['CPU'])}, DISK {len(removed['DISK'])}; tails superseded "
        f"{engine_stats(stack.server)['tails_superseded'] - before}; folded holds {len(wanted & fold(events))} "
        f"of {len(wanted)} (medium, block) of the two chunks"
    )
    assert not removed["CPU"]  # the chunk was in L1 before its tails left it
    assert None not in wanted and wanted <= fold(events)


# -- the feed of tiercache's own ---------------------------------------------------------------


@pytest.fixture(scope="module")
def feed_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("kv-feed")
    # As the first stack: L1 only, room for 15 objects, so later prompts evict the first one's chunks.
    server = ServerSpec(listen=f"ipc://{tmp}/server.sock", l1_bytes=1 * MiB, options={"chunk_size": CHUNK})
    feed = {
        "kv_events_endpoint": f"ipc://{tmp}/feed.sock",
        "kv_events_replay_endpoint": f"ipc://{tmp}/feed-replay.sock",
    }
    # Whole chunks only (no tails): the fold then holds 2 blocks per object in L1.
    with serving(tmp, server, make_prompts([FIRST] + [190] * 8, seed=37), tails=False, **feed) as s:
        yield s, feed


def test_with_a_feed_a_router_started_late_gets_the_tiers_holdings_in_a_snapshot_then_the_removals(
    feed_stack: tuple[Stack, dict[str, str]],
) -> None:
    stack, feed = feed_stack
    first = stack.prompts[0]
    stack.engine.complete(token_text(first), 2)
    full_blocks = FIRST // CHUNK * CHUNK // BLOCK
    wait_until(lambda: len(stack.events.of(BlockStored, "GPU")) > 0, timeout=60, what="vLLM's own events")

    def l1_chunks() -> int:
        with stack.server.client() as client:
            return len(client.list_keys(tier="l1")[0])

    wait_until(lambda: l1_chunks() == FIRST // CHUNK, timeout=60, what="the first prompt's chunks in L1")
    # A router that starts now, after the prompt was served, learns the chunks from the snapshot.
    router = FeedFollower(feed["kv_events_endpoint"], feed["kv_events_replay_endpoint"])
    try:
        gpu = blocks_of(stack.events.of(BlockStored, "GPU"))[:full_blocks]

        def announced() -> bool:
            if router.fold.snapshots == 0:
                router.start()
            else:
                router.pump(0.2)
            return router.fold.held.get("CPU", set()) == set(gpu)

        wait_until(
            announced, timeout=60, what="the snapshot and live batches to name the first prompt's blocks"
        )
        # Into the feed, not into vLLM's stream: that carries vLLM's own GPU blocks only.
        assert {e.medium for e in stack.events.all()} == {"GPU"}

        # 8 more prompts through an L1 of 15 objects: the first prompt's chunks are evicted, and the
        # router's fold follows L1 block for block (a chunk is 2 blocks).
        for prompt in stack.prompts[1:]:
            stack.engine.complete(token_text(prompt), 2)

        def follows() -> bool:
            router.pump(0.2)
            held = router.fold.held.get("CPU", set())
            if set(gpu) & held or len(held) != 2 * l1_chunks():
                stack.engine.complete(token_text(first[:8]), 4)  # keeps the engine stepping
                return False
            return True

        wait_until(follows, timeout=90, interval=0.1, what="the router's fold to follow L1's evictions")
        applied = router.fold.applied
        assert applied == list(range(applied[0], router.fold.next_seq))  # no gap, no duplicate

        # A router restarted now gets, in its snapshot, what the first one folded.
        restarted = FeedFollower(feed["kv_events_endpoint"], feed["kv_events_replay_endpoint"])
        try:
            restarted.start()
            router.pump(0.2)
            assert restarted.fold.as_pairs() == router.fold.as_pairs()
        finally:
            restarted.close()
    finally:
        router.close()
