"""The kernel block size vLLM's model runner gives a KV-cache group, derived from the config alone.

Kept free of torch: the scheduler half derives the layout manifest (which records kernel and
manager block sizes) in a process that has no KV tensors, and must agree with the worker.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)


def attention_backend(vllm_config: Any, spec: Any) -> Any:
    """The attention backend class vLLM selects for layers of ``spec`` (as the layers do it, from the
    config alone). Raises whatever vLLM raises when it cannot tell."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    with set_current_vllm_config(vllm_config):
        return get_attn_backend(
            spec.head_size,
            vllm_config.model_config.dtype,
            vllm_config.cache_config.cache_dtype,
            has_sliding_window=getattr(spec, "sliding_window", None) is not None,
        )


def derive_kernel_block_size(
    vllm_config: Any, kv_cache_config: Any, layer_names: Sequence[str], spec: Any
) -> int:
    """The kernel block size vLLM's GPU model runner will give this KV-cache group, from the config
    alone (the scheduler process has no tensors; both halves must agree on the fingerprint).

    Mirrors vLLM 0.32 ``prepare_kernel_block_sizes`` (``v1/worker/utils.py``): no split for specs
    without layer views, padded pages or block-outermost packed tensors; otherwise
    ``select_common_block_size`` of the group's backend. Any failure answers the manager block size;
    the worker checks the real tensors and refuses to start on a mismatch.
    """
    block = int(spec.block_size)
    try:
        if not getattr(spec, "has_layer_views", True) or getattr(spec, "page_size_padded", None) is not None:
            return block
        names = set(layer_names)
        for t in getattr(kv_cache_config, "kv_cache_tensors", ()):
            if not names.isdisjoint(getattr(t, "layers", ())) and getattr(t, "block_stride", 0) > getattr(
                t, "layer_stride", 0
            ):
                return block
        from vllm.config import set_current_vllm_config
        from vllm.v1.worker.utils import select_common_block_size

        backend = attention_backend(vllm_config, spec)
        with set_current_vllm_config(vllm_config):
            try:
                from vllm.v1.worker.utils import customize_attention_spec

                spec = customize_attention_spec(backend, spec)
            except Exception:  # older vLLM: no per-backend spec
                pass
            return int(select_common_block_size(block, [backend], [spec]))
    except Exception as exc:
        log.debug("tiercache: kernel block size not derivable from the config (%s); assuming %d", exc, block)
        return block
