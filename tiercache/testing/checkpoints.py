"""Tiny seeded checkpoints for tests and benchmarks.

A tiny model with seeded random weights (not vLLM's dummy weights, whose flat logits hide a wrong
load) makes an engine's output depend on the prompt and the KV, so a test or a benchmark can compare
a run that loaded KV from tiercache with one that computed it.

torch, safetensors and transformers are imported inside the functions: ``import tiercache`` must
stay cheap and never import torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def tiny_llama_config(
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 32,
    max_position_embeddings: int = 1024,
    torch_dtype: str = "float32",
) -> dict[str, Any]:
    """The ``config.json`` of a tiny ``LlamaForCausalLM`` (MLP twice the hidden size); the defaults
    are the e2e tests' model."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def write_tiny_checkpoint(
    directory: Path, cfg: dict[str, Any], seed: int, *, norm_weight: float = 1.0
) -> None:
    """Write ``config.json`` (``cfg`` as given) and ``model.safetensors`` with seeded random weights
    for any architecture transformers knows.

    transformers builds the model from ``cfg`` on the meta device only to name and shape the
    parameters (the names vLLM loads); the values are drawn from ``seed``: matrices ~N(0, 1/fan_in)
    (q/k projections 4x, the LM head 8x, so attention is sharp and logits spread), embeddings
    ~N(0, 1/hidden), norm weights ``norm_weight`` (0.0 for Gemma 2/3, whose norms scale by
    ``1 + weight``), other scales 1, biases 0, attention sinks ~N(0, 1). Outputs then depend on the
    prompt and the KV.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    with torch.device("meta"):
        shapes = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(directory))).state_dict()
    g = torch.Generator().manual_seed(seed)
    hidden = int(cfg["hidden_size"])
    w: dict[str, torch.Tensor] = {}
    for name, meta in shapes.items():
        shape = tuple(meta.shape)
        leaf = name.rsplit(".", 1)[-1]
        if "embed_tokens" in name:
            w[name] = torch.randn(shape, generator=g) / hidden**0.5
        elif leaf == "sinks":
            w[name] = torch.randn(shape, generator=g)
        elif len(shape) >= 2:
            # Experts are [experts, in, out] in transformers' layout; linears are [out, in].
            fan_in = shape[-2] if len(shape) == 3 else shape[-1]
            scale = 8.0 if "lm_head" in name else 4.0 if ("q_proj" in name or "k_proj" in name) else 1.0
            w[name] = torch.randn(shape, generator=g) * (scale / fan_in**0.5)
        elif "norm" in name:
            w[name] = torch.full(shape, norm_weight)
        elif leaf in ("layer_scalar", "scale"):
            w[name] = torch.ones(shape)
        else:
            w[name] = torch.zeros(shape)
    save_file({k: v.contiguous() for k, v in w.items()}, str(directory / "model.safetensors"))
