"""KV events for routers, end to end: vLLM's OpenAI server with ``--kv-events-config`` (its ZMQ
publisher) and the connector, and a subscriber that decodes with vLLM's own event classes only.

The claims: after a prompt is served, the stream carries ``BlockStored`` with tiercache's medium
(``CPU``: its L1) for exactly the prompt's full chunks, beside vLLM's own ``GPU`` events; the block
hashes equal the ones vLLM publishes for the same blocks, and a router recomputing vLLM's hashes from
the events' token ids finds them; once the server has evicted those chunks (an L1 of 15 objects, no
lower tier) the stream carries ``BlockRemoved`` for the same hashes and medium.

One vLLM server start (~40 s). Chunk 64 tokens, vLLM blocks 32, one object of 64 KiB per chunk.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
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
from tests.e2e.openai_server import OpenAIServer, api_server_argv, free_port, tiny_model_flags
from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.testing.checkpoints import token_text
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

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@dataclass
class Stack:
    server: ServerProcess
    engine: OpenAIServer
    events: Subscriber
    prompts: list[list[int]]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("kv-events")
    model = tmp / "model"
    write_served_tiny_llama(model, seed=4321)
    # L1 only, room for 15 objects: later prompts evict the first one's chunks from every tier.
    server = ServerSpec(listen=f"ipc://{tmp}/server.sock", l1_bytes=1 * MiB, options={"chunk_size": CHUNK})
    proc = ServerProcess(server)
    proc.wait_ready()
    port = free_port()
    transfer = {
        "kv_connector": "TierCacheConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"server": proc.endpoint, "kv_events_interval_s": 0.2},
    }
    publisher = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
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
    events = Subscriber(f"tcp://127.0.0.1:{port}")
    try:
        engine.wait_ready()
        yield Stack(proc, engine, events, make_prompts([FIRST] + [190] * 8, seed=23))
    finally:
        events.close()
        engine.stop()
        proc.stop()


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
