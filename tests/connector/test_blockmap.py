"""Chunks ↔ blocks per KV-cache group (``tiercache.connector.blockmap``): plain Python, no vLLM.

The shapes come from real engines: Gemma 4 on vLLM's CPU backend has a sliding group with 64-token
blocks and a full group with 32-token blocks, so for chunk 64 one chunk is 1 sliding block and 2 full
blocks, and a request's block lists differ in length (e.g. ``([1, 2], [3, 4, 5, 6])``).
"""

from __future__ import annotations

import pytest

from tiercache.connector.blockmap import (
    ChunkBlocks,
    blocks_per_chunk,
    blocks_to_load,
    blocks_to_save,
    freed_blocks,
)
from tiercache.connector.layout import check_block_sizes, check_group_specs
from tiercache.errors import ConfigError

SLIDING, FULL = 0, 1
GEMMA4_SIZES = [64, 32]  # sliding, full
CHUNK = 64


def test_a_chunk_is_chunk_size_over_block_size_blocks_of_each_group() -> None:
    assert [blocks_per_chunk(128, b) for b in (64, 32, 128)] == [2, 4, 1]
    with pytest.raises(ValueError, match="not a multiple"):
        blocks_per_chunk(96, 64)


def test_loads_place_each_chunk_in_each_groups_own_blocks() -> None:
    # 192 tokens: 3 sliding blocks of 64, 6 full blocks of 32.
    block_ids = [[11, 12, 13], [21, 22, 23, 24, 25, 26]]
    loads = blocks_to_load(block_ids, GEMMA4_SIZES, CHUNK, start=0, end=192)
    assert loads == [
        ChunkBlocks(0, ((0,), (0, 1)), ((11,), (21, 22))),
        ChunkBlocks(1, ((0,), (0, 1)), ((12,), (23, 24))),
        ChunkBlocks(2, ((0,), (0, 1)), ((13,), (25, 26))),
    ]


def test_loads_skip_what_the_engine_already_has_in_every_group() -> None:
    block_ids = [[11, 12, 13], [21, 22, 23, 24, 25, 26]]
    loads = blocks_to_load(block_ids, GEMMA4_SIZES, CHUNK, start=64, end=192)
    assert [load.chunk for load in loads] == [1, 2]
    # With chunk 128, a local hit of 64 tokens leaves the chunk's second half to load.
    loads = blocks_to_load(block_ids, GEMMA4_SIZES, 128, start=64, end=128)
    assert loads == [ChunkBlocks(0, ((1,), (2, 3)), ((12,), (23, 24)))]


def test_sliding_null_blocks_are_passed_as_null_for_the_worker_to_skip() -> None:
    # vLLM gives a sliding group's blocks before the window the null block 0.
    loads = blocks_to_load([[0, 0, 13], [21, 22, 23, 24, 25, 26]], GEMMA4_SIZES, CHUNK, 0, 192)
    assert [load.block_ids[SLIDING] for load in loads] == [(0,), (0,), (13,)]
    assert all(0 not in load.block_ids[FULL] for load in loads)


def test_a_chunk_not_allocated_in_some_group_ends_the_load() -> None:
    # The full group lacks the blocks of chunk 2: load chunks 0 and 1 only, never garbage.
    loads = blocks_to_load([[11, 12, 13], [21, 22, 23, 24, 25]], GEMMA4_SIZES, CHUNK, 0, 192)
    assert [load.chunk for load in loads] == [0, 1]


def test_equal_block_sizes_load_as_before() -> None:
    # Gemma 3 / gpt-oss: both groups 32-token blocks, 2 per chunk, same positions in both.
    loads = blocks_to_load([[0, 0, 3, 4], [5, 6, 7, 8]], [32, 32], CHUNK, 0, 128)
    assert loads == [
        ChunkBlocks(0, ((0, 1), (0, 1)), ((0, 0), (5, 6))),
        ChunkBlocks(1, ((0, 1), (0, 1)), ((3, 4), (7, 8))),
    ]


def test_saves_carry_each_groups_blocks_of_the_chunk() -> None:
    block_ids = [[11, 12, 13, 14], [21, 22, 23, 24, 25, 26, 27]]  # 200 tokens: 3 full chunks
    saves = blocks_to_save(block_ids, GEMMA4_SIZES, {SLIDING: 64}, CHUNK, first=0, end=3, computed_before=0)
    assert saves == [(0, [[11], [21, 22]]), (1, [[12], [23, 24]]), (2, [[13], [25, 26]])]


def test_saves_skip_sliding_blocks_vllm_may_have_freed_using_that_groups_block_size() -> None:
    # 256 tokens computed before this step, window 64: the next token's window starts at 193, so
    # sliding blocks (64 tokens) 0-2 may be freed; the full group still stores every chunk.
    assert freed_blocks(256, 64, 64) == 3
    assert freed_blocks(256, 64, 32) == 6  # in a group of 32-token blocks, the same tokens are 6 blocks
    block_ids = [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]
    saves = blocks_to_save(block_ids, GEMMA4_SIZES, {SLIDING: 64}, CHUNK, first=2, end=5, computed_before=256)
    assert saves == [(2, [[0], [25, 26]]), (3, [[14], [27, 28]]), (4, [[15], [29, 30]])]


def test_a_sliding_null_block_drops_only_that_groups_object() -> None:
    saves = blocks_to_save([[0, 12], [21, 22, 23, 24]], GEMMA4_SIZES, {SLIDING: 64}, CHUNK, 0, 2, 0)
    assert saves == [(0, [[0], [21, 22]]), (1, [[12], [23, 24]])]


def test_saves_stop_at_a_full_group_null_block_or_missing_blocks() -> None:
    assert blocks_to_save([[11, 12], [21, 0, 23, 24]], GEMMA4_SIZES, {SLIDING: 64}, CHUNK, 0, 2, 0) == []
    saves = blocks_to_save([[11, 12], [21, 22, 23]], GEMMA4_SIZES, {SLIDING: 64}, CHUNK, 0, 2, 0)
    assert saves == [(0, [[11], [21, 22]])]


def test_chunk_size_must_be_a_multiple_of_every_groups_block_size() -> None:
    check_block_sizes(64, 64, GEMMA4_SIZES)
    check_block_sizes(128, 64, GEMMA4_SIZES)
    with pytest.raises(ConfigError) as err:
        check_block_sizes(32, 32, GEMMA4_SIZES)  # a multiple of the full group's 32, not of 64
    msg = str(err.value)
    assert "--chunk-size 32 is not a multiple of the vLLM engine's block size 64" in msg
    assert "group 0: 64, group 1: 32" in msg and "--chunk-size 64 or a multiple" in msg
    with pytest.raises(ConfigError, match="block size 96"):
        check_block_sizes(64, 32, [96, 32])  # N = lcm(96, 32) = 96


def test_groups_with_different_block_sizes_are_accepted() -> None:
    specs = [
        type("SlidingWindowSpec", (), {"block_size": 64, "sliding_window": 64})(),
        type("FullAttentionSpec", (), {"block_size": 32})(),
    ]
    check_group_specs(specs)


def _gemma4_like_configs(cache_block_size: int = 32) -> tuple[object, object]:
    """Stand-ins for vLLM's config objects as a Gemma 4 engine gets them: the user's block size in
    cache_config, the sliding group grown to 64-token blocks, the full group at 32."""
    from types import SimpleNamespace as NS

    def spec(cls: str, block: int, head: int, **fields: object) -> object:
        attrs = {
            "block_size": block,
            "head_size": head,
            "num_kv_heads": 2,
            "dtype": "torch.float32",
            "page_size_bytes": 32768,
            **fields,
        }
        return type(cls, (), attrs)()

    vllm_config = NS(
        model_config=NS(model="tiny-gemma4", revision=None, dtype="float32"),
        parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1, decode_context_parallel_size=1),
        cache_config=NS(block_size=cache_block_size, cache_dtype="auto"),
    )
    kv_cache_config = NS(
        kv_cache_groups=[
            NS(
                kv_cache_spec=spec("SlidingWindowSpec", 64, 32, sliding_window=64),
                layer_names=["layers.0.attn"],
            ),
            NS(kv_cache_spec=spec("FullAttentionSpec", 32, 64), layer_names=["layers.1.attn"]),
        ]
    )
    return vllm_config, kv_cache_config


def test_layout_gives_each_group_its_own_blocks_per_chunk() -> None:
    from tiercache.connector.layout import derive_layout

    layout = derive_layout(*_gemma4_like_configs(), chunk_size=128, weights_id="w1")
    assert layout.scheduler_block_size == 64  # lcm(32, 64, 32), what vLLM's scheduler aligns to
    assert layout.kv_group_block_sizes() == [64, 32]
    assert [(g.blocks_per_chunk, g.object_bytes) for g in layout.groups] == [(2, 2 * 32768), (4, 4 * 32768)]
    assert [g.manifest.kernel_block_size for g in layout.groups] == [64, 32]


def test_layout_refuses_a_chunk_that_is_not_a_multiple_of_every_groups_block_size() -> None:
    from tiercache.connector.layout import derive_layout

    # 32 is the user's --block-size and the full group's, but the sliding group's blocks are 64.
    with pytest.raises(
        ConfigError, match=r"--chunk-size 32 is not a multiple of the vLLM engine's block size 64"
    ):
        derive_layout(*_gemma4_like_configs(), chunk_size=32, weights_id="w1")
