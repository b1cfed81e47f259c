"""Tails (``"tails": true``) on a real vLLM CPU engine: a fresh engine's hit ends where vLLM's own
prefix cache's would, block by block, not at the last full chunk.

Chunk 128, vLLM blocks 32 (engine_run's), so a chunk is 4 blocks and a tail up to 3. Prompts, cold:
A (200 tokens), B (220), C (300), D (100), all random. Then a fresh engine on a warm server asks
for A–D again and for two prompts it never ran:

* E: A's first 160 tokens (chunk 0 and block 4, both stored by A) and 70 new ones;
* T: B, B's 8 generated tokens and 20 new ones: the second turn of a chat. B's end stored the KV
  of its generated tokens up to its last full block (token 224), past its prompt's tail (192).

vLLM's own prefix cache, with every earlier request's blocks cached, would hit every full block
the prompt shares with them short of the prompt's last token (``Fresh.expected``). Each engine runs
in its own process, and the fresh ones with vLLM's own prefix cache off (else E and T, scheduled
after A and B had run, would hit A's and B's blocks inside that engine), so every token they report
cached came from tiercache. The same engine with tails off (the negative control) hits whole chunks
only.

Run on a dense model (tiny Llama) and on a sliding-window hybrid (tiny Gemma 3: a 64-token window,
two blocks, so the sliding group's older blocks are vLLM's null block on a load and may be freed
before a request's end stores).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.e2e.engine_run import write_tiny_gemma3, write_tiny_llama
from tests.e2e.setup import MiB, Run, engine_stats, run_engine, wait_for_stores
from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.keys import ExtraKeys, ObjectKey, PrefixHasher, tail_hashes

pytestmark = pytest.mark.e2e

CHUNK, BLOCK, MAX_TOKENS = 128, 32, 8
TAILS = {"tails": True}


def _tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


def _blocks_of(n: int) -> int:
    """The tokens vLLM's prefix cache can reuse of an ``n``-token prompt it has wholly cached."""
    return (n - 1) // BLOCK * BLOCK


@dataclass
class World:
    tmp: Path
    model: Path
    server: ServerProcess
    cold_prompts: list[list[int]]  # A, B, C, D
    cold: Run
    name: str  # which model

    def run(
        self, name: str, prompts: list[list[int]], *, local_cache: bool = False, **connector: object
    ) -> Run:
        """One engine process on ``prompts``; vLLM's own prefix cache only with ``local_cache``."""
        path = self.tmp / f"{name}-prompts.json"
        path.write_text(json.dumps(prompts))
        return run_engine(
            self.model,
            self.server.endpoint,
            path,
            self.tmp / f"{name}.json",
            engine_args={"enable_prefix_caching": local_cache},
            connector_config=dict(connector),
        )


MODELS = {"dense": write_tiny_llama, "sliding": write_tiny_gemma3}
GROUPS = {"dense": 1, "sliding": 2}  # object groups: every tail and chunk is one object per group
TAIL_STORES = {"dense": 4, "sliding": 5}  # tail objects the cold run stores (see ``world``)


@pytest.fixture(scope="module", params=sorted(MODELS))
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp(f"tails-{request.param}")
    model = tmp / "model"
    MODELS[request.param](model, seed=1234)
    rng = random.Random(5)
    a = _tokens(200, rng)
    prompts = [a, _tokens(220, rng), _tokens(300, rng), _tokens(100, rng)]
    server = ServerProcess(
        ServerSpec(listen=f"ipc://{tmp}/server.sock", l1_bytes=64 * MiB, options={"chunk_size": CHUNK})
    )
    try:
        server.wait_ready()
        w = World(tmp, model, server, prompts, Run([], [], []), request.param)
        w.cold = w.run("cold", prompts, local_cache=True, **TAILS)
        # Full chunks: 1 + 1 + 2 + 0; tails, one object each at each request's end: A's of 2 blocks,
        # B's of 3, C's of 1, D's of 3 (the sliding model also stores each prompt's tail once
        # computed: B's of 2 too).
        wait_for_stores(server, (4 + TAIL_STORES[request.param]) * GROUPS[request.param])
        yield w
    finally:
        server.stop()


@dataclass
class Fresh:
    prompts: list[list[int]]  # A, B, C, D, E, T
    expected: list[int]  # vLLM's own prefix cache's hit, per prompt
    tails: Run
    whole_chunks: Run  # the same prompts, tails off


@pytest.fixture(scope="module")
def fresh(world: World) -> Fresh:
    a, b = world.cold_prompts[0], world.cold_prompts[1]
    rng = random.Random(9)
    e = a[:160] + _tokens(70, rng)
    t = b + world.cold.tokens[1] + _tokens(20, rng)
    prompts = [*world.cold_prompts, e, t]
    computed_b = len(b) + MAX_TOKENS - 1  # B's KV at its end: the last sampled token has none
    expected = [*(_blocks_of(len(p)) for p in world.cold_prompts), 160, computed_b // BLOCK * BLOCK]
    tails = world.run("fresh-tails", prompts, **TAILS)
    whole = world.run("fresh-whole-chunks", prompts, tails=False)
    return Fresh(prompts, expected, tails, whole)


def test_a_fresh_engines_hit_ends_where_vllms_own_prefix_cache_would(world: World, fresh: Fresh) -> None:
    print(
        f"\n[e2e tails {world.name}] cached {fresh.tails.num_cached}, vLLM's own {fresh.expected}, "
        f"whole chunks only {fresh.whole_chunks.num_cached}"
    )
    assert fresh.expected == [192, 192, 288, 96, 160, 224]
    assert fresh.tails.num_cached == fresh.expected


def test_with_tails_off_the_hit_stops_at_the_last_full_chunk(fresh: Fresh) -> None:
    """The negative control: the same engine and server, tails off."""
    assert fresh.whole_chunks.num_cached == [(len(p) - 1) // CHUNK * CHUNK for p in fresh.prompts]
    assert fresh.whole_chunks.num_cached != fresh.tails.num_cached


def test_outputs_with_tails_equal_the_cold_run_and_the_whole_chunk_run(world: World, fresh: Fresh) -> None:
    cold = len(world.cold_prompts)
    assert fresh.tails.tokens[:cold] == world.cold.tokens
    assert fresh.tails.tokens == fresh.whole_chunks.tokens
    diffs = [
        abs(x - y)
        for run in (world.cold, fresh.whole_chunks)
        for p, q in zip(fresh.tails.logprobs, run.logprobs)
        for x, y in zip(p, q)
    ]
    assert max(diffs) <= 1e-5


def _l1_hashes(server: ServerProcess) -> set[bytes]:
    with server.client() as c:
        keys, _ = c.list_keys(tier="l1", limit=10_000)
    return {ObjectKey.from_bytes(k.key).prefix_hash for k in keys}


def _tails_of(prompt: list[int], chunk: int, blocks: int) -> list[bytes]:
    hasher = PrefixHasher(CHUNK, ExtraKeys())
    hasher.update(prompt)
    return tail_hashes(hasher.before(chunk), prompt[chunk * CHUNK : chunk * CHUNK + blocks * BLOCK], BLOCK)


def test_storing_the_full_chunk_supersedes_the_tails_it_covers(world: World, fresh: Fresh) -> None:
    """A third turn of B's chat fills B's chunk 1.

    Dense: the chunk's commit drops B's tail of 3 blocks (stored at B's end, B's only); A's tail,
    another prefix, stays. Sliding: B's prompt's tail of 2 was stored once computed, and B's end
    came after its sliding group's first block of chunk 1 left the window, so B's tail of 3 holds
    zeros there, names only its last block for the block index and superseded nothing; the third turn's engine, which
    loaded B's blocks, stores the chunk without that group's object (out of its window too), so the
    chunk replaces no tail and both of B's stay (they still serve B's and T's prompts)."""
    a, b = world.cold_prompts[0], world.cold_prompts[1]
    turn3 = fresh.prompts[5] + _tokens(60, random.Random(11))
    b_end = _tails_of(turn3, 1, CHUNK // BLOCK - 1)[-1]  # B's end tail: T and turn 3 share its blocks
    b_prompt = _tails_of(b, 1, 2)[-1]
    a_tail = _tails_of(a, 1, 2)[-1]
    held = _l1_hashes(world.server)
    dense = world.name == "dense"
    assert {b_end, a_tail} <= held
    assert (b_prompt in held) is not dense
    before = engine_stats(world.server)["tails_superseded"]
    world.run("turn3", [turn3], **TAILS)  # its commit's reply comes once the tails are dropped
    held = _l1_hashes(world.server)
    assert a_tail in held
    if dense:
        assert b_end not in held
        assert engine_stats(world.server)["tails_superseded"] - before == GROUPS[world.name]
    else:
        assert {b_end, b_prompt} <= held
        assert engine_stats(world.server)["tails_superseded"] == before
