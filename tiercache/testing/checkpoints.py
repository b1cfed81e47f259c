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


#: The chat template :func:`write_tokenizer` saves: ``<s>`` then each message's content, space-separated
#: (no role words: every word of a prompt must be one of the tokenizer's words).
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %} {{ message['content'] }}{% endfor %}"

#: The words :func:`write_tokenizer` gives its special ids; every other id ``i`` is the word ``t{i}``.
SPECIAL_WORDS = {0: "<pad>", 1: "<s>", 2: "</s>"}


def token_word(token_id: int) -> str:
    """The word :func:`write_tokenizer`'s tokenizer has for ``token_id``."""
    return SPECIAL_WORDS.get(token_id, f"t{token_id}")


def token_text(token_ids: list[int]) -> str:
    """``token_ids`` as the text :func:`write_tokenizer`'s tokenizer encodes back to exactly them."""
    return " ".join(token_word(t) for t in token_ids)


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """Write a tokenizer for a tiny checkpoint into ``directory`` (next to its ``config.json``), so an
    OpenAI server or a load generator can serve it: decode → encode round-trips exactly.

    A ``tokenizers`` ``WordLevel`` model with one word per id (:func:`token_word`: ``<pad>`` = 0,
    ``<s>`` = 1 (bos), ``</s>`` = 2 (eos), ``t3`` … ``t{vocab_size - 1}``; an unknown word encodes as
    ``<pad>``), a ``WhitespaceSplit`` pre-tokenizer, no post-processor (nothing is added to a prompt)
    and a decoder that joins the words with single spaces. Saved as ``tokenizer.json`` plus a
    ``tokenizer_config.json`` naming ``PreTrainedTokenizerFast`` (``AutoTokenizer`` loads it), with
    :data:`CHAT_TEMPLATE` so ``/v1/chat/completions`` works: a chat renders as ``<s> CONTENT ...``.
    Only ``tokenizers`` is needed to write it; no download is involved.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if vocab_size <= len(SPECIAL_WORDS):
        raise ValueError(f"vocab_size {vocab_size} leaves no ordinary words")
    tok = Tokenizer(
        models.WordLevel(vocab={token_word(i): i for i in range(vocab_size)}, unk_token=SPECIAL_WORDS[0])
    )
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # no word starts with ##: joins with spaces
    tok.add_special_tokens(list(SPECIAL_WORDS.values()))  # skipped by decode(skip_special_tokens=True)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": SPECIAL_WORDS[0],
        "bos_token": SPECIAL_WORDS[1],
        "eos_token": SPECIAL_WORDS[2],
        "unk_token": SPECIAL_WORDS[0],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
