"""Object groups per parallel rank (``tiercache.connector.layout``): plain Python, no vLLM.

Every TP/PP rank holds other KV (its share of the KV heads, its stage's layers), so it stores into
its own object group, ``kv_group * world + rank``, under its own fingerprint. The worker's rank
(:func:`parallel_rank`, from vLLM's process groups) must be the one :func:`derive_layout` numbered
its groups by; ``test_tensor_parallel.py`` runs TP 2 on a real engine.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from tiercache.connector.layout import derive_layout, parallel_rank
from tiercache.errors import ConfigError


def _configs(tp: int, pp: int, pcp: int = 1) -> tuple[NS, NS]:
    """Stand-ins for vLLM's config objects: one full-attention KV-cache group of two layers."""
    spec = type(
        "FullAttentionSpec",
        (),
        {
            "block_size": 32,
            "head_size": 32,
            "num_kv_heads": 2 // min(tp, 2),
            "dtype": "torch.float32",
            "page_size_bytes": 8192,
        },
    )()
    vllm_config = NS(
        model_config=NS(model="tiny-llama", revision=None, dtype="float32"),
        parallel_config=NS(
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=pcp,
        ),
        cache_config=NS(block_size=32, cache_dtype="auto"),
    )
    kv_cache_config = NS(
        kv_cache_groups=[NS(kv_cache_spec=spec, layer_names=["layers.0.attn", "layers.1.attn"])]
    )
    return vllm_config, kv_cache_config


def _unavailable() -> tuple[int, int, int, int]:
    raise AssertionError("vLLM's parallel groups are not initialized")


def test_each_rank_gets_its_own_object_group_and_fingerprint() -> None:
    layout = derive_layout(*_configs(tp=2, pp=2), chunk_size=64, weights_id="w1")
    assert layout.world_size == 4
    assert [(g.object_group, g.manifest.tp_rank, g.manifest.pp_rank) for g in layout.groups] == [
        (0, 0, 0),
        (1, 1, 0),
        (2, 0, 1),
        (3, 1, 1),
    ]
    assert len({g.fingerprint.raw for g in layout.groups}) == 4
    single = derive_layout(*_configs(tp=1, pp=1), chunk_size=64, weights_id="w1")
    assert single.groups[0].fingerprint.raw not in {g.fingerprint.raw for g in layout.groups}


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2), (4, 2)])
def test_the_workers_rank_is_the_one_its_object_groups_were_numbered_by(tp: int, pp: int) -> None:
    vllm_config, kv_cache_config = _configs(tp, pp)
    layout = derive_layout(vllm_config, kv_cache_config, chunk_size=64, weights_id="w1")
    seen = set()
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            rank = parallel_rank(vllm_config.parallel_config, lambda t=tp_rank, q=pp_rank: (t, tp, q, pp))
            [group] = layout.for_rank(rank)
            assert (group.manifest.tp_rank, group.manifest.pp_rank) == (tp_rank, pp_rank)
            seen.add(group.object_group)
    assert seen == set(range(tp * pp))  # every object group has exactly one worker


def test_a_single_rank_engine_is_rank_0_without_vllms_groups() -> None:
    assert parallel_rank(_configs(1, 1)[0].parallel_config, _unavailable) == 0
    assert parallel_rank(None, _unavailable) == 0  # unit tests build a WorkerHalf without a config


def test_a_rank_that_cannot_be_told_refuses_to_start_instead_of_guessing_rank_0() -> None:
    """Guessing 0 would make rank 1 store its KV heads as rank 0's objects."""
    parallel = _configs(2, 1)[0].parallel_config
    with pytest.raises(ConfigError, match="cannot tell this worker's rank"):
        parallel_rank(parallel, _unavailable)
    with pytest.raises(ConfigError, match="do not match the config"):
        parallel_rank(parallel, lambda: (1, 4, 0, 1))  # vLLM's TP group is not the configured size
    with pytest.raises(ConfigError, match="do not match the config"):
        parallel_rank(parallel, lambda: (2, 2, 0, 1))  # rank out of range


def test_prefill_context_parallelism_is_refused() -> None:
    """PCP ranks hold other tokens' KV for the same TP rank: they would share an object group."""
    with pytest.raises(ConfigError, match="prefill context parallelism"):
        derive_layout(*_configs(tp=2, pp=1, pcp=2), chunk_size=64, weights_id="w1")
