"""Tiny configurations of the models whose vLLM 0.32 kernels do not run on CPU, for
``tests/e2e/test_gpu_models.py``: Kimi-Linear (KDA + MLA), DeepSeek-V4 (compressed / sliding MLA with
hyper-connections), GLM-5 (MLA with DeepSeek Sparse Attention) and MiniMax-M3 (GQA with a
block-sparse indexer).

Each config keeps every layer kind its model has (dense and MoE MLPs, every attention kind) and the
dims its GPU kernels are specialised for (MLA latent 512 + rope 64, indexer head dim 128, KDA head dim
128), and shrinks the rest: hidden 256, 2-4 layers, 4 routed experts, vocab 512 (the e2e prompts'
token ids are < 512). Weights are seeded dummy weights (``tests/e2e/seeded_dummy_run.py``).

What a CPU engine start (vLLM 0.32 CPU build, this venv) does with each config is recorded next to it
(``CPU_RESULT``); see docs/hybrid-models.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.e2e.seeded_dummy_run import write_seeded_dummy_model

VOCAB = 512
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

# Kimi-Linear (moonshotai/Kimi-Linear-48B-A3B layout): layers 1-2 KDA (1-indexed in
# linear_attn_config, as in the released config), layer 3 MLA without RoPE (mla_use_nope, q_lora_rank
# None as released); layer 0 a dense MLP, layers 1-2 MoE (sigmoid router, grouped top-k, a shared
# expert). KDA state per sequence: conv 3 x (3 x 512) bf16 + 4 x 128 x 128 fp32 = 271 360 bytes; MLA
# page 576 x 2 bytes per token, so vLLM 0.32 should unify the block size to
# N = 128 * ceil(271360 / (128 * 1152)) = 256 (platforms/interface.py; 128 = the MLA alignment for
# hybrids). The test does not rely on that: it reads N from the connector's start-up refusal if the
# first chunk size is wrong.
TINY_KIMI_LINEAR: dict[str, Any] = {
    **COMMON,
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "num_experts": 4,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "moe_intermediate_size": 128,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.0,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "num_nextn_predict_layers": 0,
    "linear_attn_config": {
        "kda_layers": [1, 2],
        "full_attn_layers": [3],
        "num_heads": 4,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
}
KIMI_LINEAR_N_GUESS = 256

# DeepSeek-V4 (the released config.json keys, which vLLM's own DeepseekV4Config reads as they are):
# layer 0 sliding-window attention only (compress ratio 0) with a hash-routed MoE (num_hash_layers 1),
# layer 1 compressed sparse attention (ratio 4, with the indexer), layer 2 heavily compressed
# attention (ratio 128); hyper-connections (hc_mult 4) as released. No quantization_config: bf16
# weights and experts.
TINY_DEEPSEEK_V4: dict[str, Any] = {
    **COMMON,
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "moe_intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_lora_rank": 128,
    "o_groups": 8,
    "num_experts_per_tok": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "num_hash_layers": 1,
    "compress_ratios": [0, 4, 128],
    "compress_rope_theta": 160000.0,
    "rope_theta": 10000.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "swiglu_limit": 10.0,
    "sliding_window": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "num_nextn_predict_layers": 0,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
}

# GLM-5 (zai-org GLM-5 layout, transformers' GlmMoeDsaConfig keys): MLA (latent 512 + rope 64, nope
# 192, v 256, q LoRA) with the DSA lightning indexer (32 heads of 128, top-2048: with the tests'
# short prompts every token is selected, as in any prompt shorter than index_topk); layer 0 dense
# MLP, layer 1 MoE.
TINY_GLM_MOE_DSA: dict[str, Any] = {
    **COMMON,
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "head_dim": 64,
    "kv_lora_rank": 512,
    "q_lora_rank": 128,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "num_nextn_predict_layers": 0,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}

# MiniMax-M3 (MiniMax-M3-preview text backbone, vLLM's MiniMaxM3TextConfig keys inside the released
# "minimax_m3_vl" wrapper, vision left out): layer 0 dense attention + dense MLP, layer 1 block-sparse
# attention (indexer: 4 heads of 128, 128-token index blocks, top-16 blocks + 1 local) + MoE with a
# shared expert; GQA 8 query / 4 KV heads of 128, partial rotary 64, Gemma-style norms, qk norm.
TINY_MINIMAX_M3_TEXT: dict[str, Any] = {
    **{k: v for k, v in COMMON.items() if k != "torch_dtype"},
    "architectures": ["MiniMaxM3SparseForCausalLM"],
    "model_type": "minimax_m3_text",
    "intermediate_size": 128,
    "dense_intermediate_size": 512,
    "shared_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,  # = sparse_num_index_heads (vLLM's fused QKV + indexer projection asserts it)
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "rotary_dim": 64,
    "partial_rotary_factor": 0.5,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "num_mtp_modules": 0,
    "moe_layer_freq": [0, 1],
    "sparse_attention_config": {
        "use_sparse_attention": True,
        "sparse_index_dim": 128,
        "sparse_num_index_heads": 4,
        "sparse_topk_blocks": 16,
        "sparse_block_size": 128,
        "sparse_disable_index_value": [0, 1],
        "sparse_score_type": "max",
        "sparse_init_block": 0,
        "sparse_local_block": 1,
        "sparse_attention_freq": [0, 1],
    },
}
TINY_MINIMAX_M3: dict[str, Any] = {
    "architectures": ["MiniMaxM3SparseForCausalLM"],
    "model_type": "minimax_m3_vl",
    "text_config": TINY_MINIMAX_M3_TEXT,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}

# What a vLLM 0.32 CPU engine start (tests.e2e.seeded_dummy_run, bf16, block size 64) does with each
# config: how far the CPU build gets, so that a GPU failure elsewhere is a GPU finding.
CPU_RESULT: dict[str, str] = {
    "kimi_linear": (
        "config parsed, architecture resolved; the CPU platform turns prefix caching off for MLA ('MLA is "
        "enabled on a non-GPU platform'), then VllmConfig fails: '--mamba-block-size can only be set with "
        "--enable-prefix-caching'. With prefix caching off the model build stops at 'import cutlass' "
        "(CUDA CuTe DSL) in KimiLinearModel.__init__ (maybe_init_gemm_rs_ar)."
    ),
    "deepseek_v4": (
        "builds, loads (79 seeded parameters) and allocates its KV cache (CPU backend forces block 256; "
        "6 groups, block sizes 64, 64, 64, 256, 4, 8); the connector's worker then refuses: 'KV-cache group 0 "
        "is UniformTypeKVCacheSpecs'. Without the connector the first forward fails in the sparse-SWA "
        "metadata build (a Triton op; no Triton on CPU)."
    ),
    "glm_moe_dsa": "model build: NotImplementedError 'Sparse Attention is not supported on CPU.' (layer 0's MLA backend).",
    "minimax_m3": (
        "needs an import-only torchvision stub (its module imports torchvision); model build: NotImplementedError "
        "'No Unquantized MoE backend supports the deployment configuration' (the MoE layer)."
    ),
}

CONFIGS: dict[str, dict[str, Any]] = {
    "kimi_linear": TINY_KIMI_LINEAR,
    "deepseek_v4": TINY_DEEPSEEK_V4,
    "glm_moe_dsa": TINY_GLM_MOE_DSA,
    "minimax_m3": TINY_MINIMAX_M3,
}


def tiny_qwen3_next_config() -> dict[str, Any]:
    """The CPU stand-in for Kimi-Linear's recurrent path: test_recurrent's tiny Qwen3-Next (Gated
    DeltaNet + full attention; vLLM's unified block size N = 384 on CPU)."""
    from tests.e2e.engine_run import tiny_qwen3_next_config as config

    return config().to_dict()  # type: ignore[no-any-return]


def _config(name: str) -> dict[str, Any]:
    if name == "llama_cpu":
        from tiercache.testing.checkpoints import tiny_llama_config

        return tiny_llama_config()
    if name == "qwen3_next_cpu":
        return tiny_qwen3_next_config()
    return CONFIGS[name]


def writer(name: str) -> Any:
    """A :class:`tests.e2e.setup.ModelWriter` for ``CONFIGS[name]`` or a CPU stand-in (``llama_cpu``,
    ``qwen3_next_cpu``): config + seed file."""

    def write(directory: Path, *, seed: int) -> None:
        write_seeded_dummy_model(directory, _config(name), seed)

    return write


def main() -> None:
    """``python -m tests.e2e.gpu_models DIR``: write every tiny model under ``DIR/<name>`` and show
    how vLLM's config loader parses it (the CPU-side check of these configs)."""
    import sys

    from vllm.transformers_utils.config import get_config

    out = Path(sys.argv[1])
    for name in CONFIGS:
        writer(name)(out / name, seed=1234)
        try:
            config = get_config(str(out / name), trust_remote_code=False)
            text = config.get_text_config()
            print(
                f"{name}: {type(config).__name__} / {type(text).__name__}, architectures {config.architectures}, "
                f"{text.num_hidden_layers} layers, hidden {text.hidden_size}"
            )
        except Exception as e:  # report every model, not just the first failure
            print(f"{name}: FAILED {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
