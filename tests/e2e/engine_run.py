"""Run one fresh vLLM CPU engine with the tiercache connector and write its outputs as JSON.

Used by the e2e tests, one process per engine (a fresh engine = a fresh process)::

    python -m tests.e2e.engine_run --model DIR --server ipc://... --prompts p.json --out o.json

Writes ``{"tokens": [[...]], "logprobs": [[...]], "num_cached": [...]}``: greedy token ids, the
log-probability of each chosen token, and vLLM's count of prompt tokens it did not compute
(local prefix cache + tiercache; a fresh engine has no local cache of these prompts). With
``--log-stats`` the engine runs with vLLM's stat loggers, logs its "KV Transfer metrics:" line at
the end and adds ``"metrics"``: the ``vllm:tiercache_*`` Prometheus values from ``LLM.get_metrics()``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tiercache.testing.checkpoints import tiny_llama_config, write_tiny_checkpoint, write_tokenizer

MiB = 1 << 20

#: Called with each prompt's index just before it is generated: a launcher's per-prompt switch (e.g.
#: ``slow_load_run`` skipping the layer waits for some prompts only).
BEFORE_PROMPT: Callable[[int], None] | None = None


def write_tiny_llama(directory: Path, seed: int) -> None:
    """A tiny Llama checkpoint with seeded random weights, so outputs depend on the KV."""
    write_tiny_checkpoint(directory, tiny_llama_config(), seed)


def write_served_tiny_llama(directory: Path, seed: int) -> None:
    """:func:`write_tiny_llama` with a word-level tokenizer over its whole vocabulary beside it, as
    vLLM's OpenAI server needs (prompts are :func:`~tiercache.testing.checkpoints.token_text`)."""
    write_tiny_llama(directory, seed)
    write_tokenizer(directory, tiny_llama_config()["vocab_size"])


SLIDING_AND_FULL: dict = {
    # What the tiny two-group models share: the tests' dims, layer 0 attends over a sliding window of
    # 64 tokens (1 chunk of 64), layer 1 over everything.
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "sliding_window": 64,
    "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

TINY_GEMMA3: dict = {
    # Gemma 3: a sliding and a full-attention layer with the same head size (two KV-cache groups).
    **SLIDING_AND_FULL,
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "query_pre_attn_scalar": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_local_base_freq": 10000.0,
    "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
}


def write_tiny_gemma3(directory: Path, seed: int) -> None:
    """A tiny Gemma 3 (``Gemma3ForCausalLM``, :data:`TINY_GEMMA3`) with seeded random weights."""
    write_tiny_checkpoint(directory, TINY_GEMMA3, seed, norm_weight=0.0)  # Gemma norms scale by 1 + weight


TINY_GEMMA4: dict = {
    # Gemma 4: the sliding layer (head 32) and the full layer (head 64) have pages of different size
    # per token, so vLLM gives the sliding group 64-token blocks and the full group 32-token ones.
    **SLIDING_AND_FULL,
    "architectures": ["Gemma4ForCausalLM"],
    "model_type": "gemma4_text",
    "vocab_size_per_layer_input": 512,
    "hidden_size_per_layer_input": 0,
    "global_head_dim": 64,
}

TINY_GPT_OSS: dict = {
    # gpt-oss: sliding window 64 + full attention with sinks, MoE; vLLM puts the sliding window on
    # even layers whatever layer_types says, so layer_types states just that.
    **SLIDING_AND_FULL,
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "intermediate_size": 128,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    # vLLM's gpt-oss always builds YaRN rope from these keys (as in the released checkpoints).
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "original_max_position_embeddings": 32,  # x factor 32 = max_position_embeddings
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    },
}


def tiny_qwen3_next_config() -> Any:
    """The config of :func:`write_tiny_qwen3_next` (a ``transformers`` ``Qwen3NextConfig``)."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=4096,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        architectures=["Qwen3NextForCausalLM"],
    )


def write_tiny_qwen3_next(directory: Path, seed: int) -> None:
    """A tiny Qwen3-Next (``Qwen3NextForCausalLM``) with seeded random weights: layer 0 is Gated
    DeltaNet linear attention (recurrent state: a conv window and a 2x128x128 SSM state), layer 1 full
    attention; a 4-expert MoE in both. vLLM keeps them in a ``MambaSpec`` and a full-attention group.

    Linear head dim 128 is what the CPU GDN kernels need (they also need bfloat16); head dim 64 makes
    vLLM's unified block size 384 (attention page >= the 131 KiB state page). Shapes come from transformers' own model
    class; matrices are drawn ~N(0, 1/fan_in) (q/k and lm_head larger) so outputs depend on the state.
    """
    _save_seeded_recurrent_checkpoint(directory, tiny_qwen3_next_config(), seed)


def write_tiny_qwen3_5(directory: Path, seed: int) -> None:
    """A tiny Qwen3.5 (``Qwen3_5ForCausalLM``, text-only) with seeded random weights: layer 0 Gated
    DeltaNet linear attention, layer 1 full (gated) attention, dense MLPs. Same dims as
    :func:`write_tiny_qwen3_next` (linear head dim 128, head dim 64, bfloat16 in the engine), so vLLM's
    unified block size is 384 here too. vLLM's Qwen3.5 path imports torchvision: run its engine with
    :func:`write_torchvision_stub` on ``PYTHONPATH`` where torchvision is absent.
    """
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=4096,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        architectures=["Qwen3_5ForCausalLM"],
    )
    _save_seeded_recurrent_checkpoint(directory, config, seed)


GRANITE_CHECKPOINT_NAMES = {
    # transformers 5 renames Granite's checkpoint names on load (conversion_mapping "granitemoe");
    # vLLM's loader reads the checkpoint's own names, so the writer undoes the renaming.
    "block_sparse_moe.experts.gate_up_proj": "block_sparse_moe.input_linear.weight",
    "block_sparse_moe.experts.down_proj": "block_sparse_moe.output_linear.weight",
    "block_sparse_moe.router.weight": "block_sparse_moe.router.layer.weight",
}


def write_tiny_granite4(directory: Path, seed: int) -> None:
    """A tiny IBM Granite 4 hybrid (``GraniteMoeHybridForCausalLM``) with seeded random weights:
    layer 0 Mamba2 (recurrent state: a conv window of 3 x 512 and a 4x64x128 SSM state), layer 1 full
    attention (RoPE); a 4-expert MoE plus a shared MLP in both, as in Granite-4.0-H-Tiny. vLLM keeps
    them in a ``MambaSpec`` and a full-attention group.

    float32 state: 137 KiB per page, so with head dim 32 and 2 KV heads (512 B per token) vLLM's
    unified block size is 384, as for the Gated DeltaNet models.
    """
    import torch
    from transformers import GraniteMoeHybridConfig

    config = GraniteMoeHybridConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=4,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=128,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=256,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=256,
        position_embedding_type="rope",
        layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=4096,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        architectures=["GraniteMoeHybridForCausalLM"],
    )

    def rename(name: str) -> str:
        for new, old in GRANITE_CHECKPOINT_NAMES.items():
            name = name.replace(new, old)
        return name

    # transformers' Mamba2 init (A = -1..-4, dt_bias 1) forgets within a few tokens: the state at a
    # hit boundary would have no effect on the logits (a foreign state moved them by exactly 0). Slow
    # decay per token (dt = softplus(x - 4) ~ 0.02, A = -0.01..-0.1) keeps it: ~0.6..1 after 200 tokens.
    vectors = {
        "mamba.A_log": torch.log(torch.tensor([0.01, 0.02, 0.05, 0.1])),
        "mamba.dt_bias": torch.full((4,), -4.0),
    }
    _save_seeded_recurrent_checkpoint(directory, config, seed, rename=rename, vectors=vectors)


def _save_seeded_recurrent_checkpoint(
    directory: Path,
    config: Any,
    seed: int,
    rename: Callable[[str], str] | None = None,
    vectors: dict[str, Any] | None = None,
) -> None:
    """Shapes from transformers' own model class; matrices ~N(0, 1/fan_in) (q/k and lm_head larger)
    so outputs depend on the state; 1-D parameters (norms, A_log, dt_bias, D) keep transformers' init.
    ``rename`` maps a transformers parameter name to the checkpoint's (applied first; a fused expert
    tensor it renames is stored fused, as the checkpoint has it); ``vectors`` replaces the init of the
    1-D parameters whose names end with its keys."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)  # transformers' own init (1-D parameters: norms, A_log, dt_bias) is kept
    shapes = AutoModelForCausalLM.from_config(config).state_dict()
    g = torch.Generator().manual_seed(seed)

    def mat(shape: tuple[int, ...], scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * (scale / shape[-1] ** 0.5)

    w: dict[str, torch.Tensor] = {}
    for name, ref in shapes.items():
        name = rename(name) if rename else name
        if name == "model.embed_tokens.weight":
            w[name] = torch.randn(*ref.shape, generator=g)
        elif ref.dim() == 1:
            override = [v for suffix, v in (vectors or {}).items() if name.endswith(suffix)]
            w[name] = (override[0] if override else ref).clone()
        elif name.endswith("experts.gate_up_proj"):  # fused in transformers 5; checkpoints list experts
            for e, t in enumerate(mat(tuple(ref.shape))):
                gate, up = t.chunk(2, dim=0)
                w[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                w[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif name.endswith("experts.down_proj"):
            for e, t in enumerate(mat(tuple(ref.shape))):
                w[name.replace("down_proj", f"{e}.down_proj.weight")] = t
        else:
            scale = (
                8.0
                if name == "lm_head.weight"
                else 4.0
                if name.endswith(("q_proj.weight", "k_proj.weight"))
                else 1.0
            )
            w[name] = mat(tuple(ref.shape), scale)
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    save_file({k: v.contiguous() for k, v in w.items()}, str(directory / "model.safetensors"))


TORCHVISION_STUB = {
    # transformers' image processors (imported by vLLM's Qwen3.5 model module through Qwen3-VL)
    # import these torchvision modules and names at import time; nothing calls them for text.
    "torchvision/__init__.py": '__version__ = "0.0.0+stub"\n',
    "torchvision/io.py": "ImageReadMode = decode_image = None\n",
    "torchvision/transforms/__init__.py": (
        "import enum\n\n\nclass InterpolationMode(enum.Enum):\n"
        + "".join(
            f"    {m} = {m.lower()!r}\n"
            for m in ("NEAREST", "NEAREST_EXACT", "BILINEAR", "BICUBIC", "BOX", "HAMMING", "LANCZOS")
        )
    ),
    "torchvision/transforms/functional.py": "pil_to_tensor = None\n",
    "torchvision/transforms/v2/__init__.py": "",
    "torchvision/transforms/v2/functional.py": "",
}


def write_torchvision_stub(directory: Path) -> Path:
    """An import-only ``torchvision`` package under ``directory`` (for an engine's PYTHONPATH only):
    the vLLM CPU venv has no torchvision, yet vLLM's Qwen3.5 module imports it unconditionally."""
    for rel, text in TORCHVISION_STUB.items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return directory


def make_prompts(lengths: list[int], seed: int = 7, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def run(
    model: str,
    server: str,
    prompts: list[list[int]],
    max_tokens: int,
    engine_args: dict | None = None,
    log_stats: bool = False,
    connector_config: dict | None = None,
    kv_role: str = "kv_both",
) -> dict[str, Any]:
    """Generate greedily for each prompt, alone in its batch; ``engine_args`` override the defaults
    (e.g. ``mamba_cache_mode`` and a bfloat16 dtype for GDN models); ``log_stats`` runs vLLM's stat
    loggers and reports tiercache's metrics; ``kv_role`` is the connector's (a prefill engine's
    ``kv_producer`` reserves its stores before each step returns)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    args: dict = {
        "model": model,
        "load_format": "safetensors",
        "skip_tokenizer_init": True,
        "enable_prefix_caching": True,
        "max_model_len": 1024,
        "dtype": "float32",
        "max_num_seqs": 8,
        "max_num_batched_tokens": 1024,
        "enforce_eager": True,
        "block_size": 32,
        "distributed_executor_backend": "uni",
        "kv_cache_memory_bytes": 64 * MiB,
        "seed": 0,
        "disable_log_stats": not log_stats,
    }
    args.update(engine_args or {})
    llm = LLM(
        **args,
        kv_transfer_config={
            "kv_connector": "TierCacheConnector",
            "kv_connector_module_path": "tiercache.connector",
            "kv_role": kv_role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"server": server, "timeout_s": 5.0, **(connector_config or {})},
        },
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)
    # One prompt at a time: vLLM's CPU kernels are not batch-invariant (a request's logprobs move by
    # ~1e-5 with what else is in its batch), and lookups make admission timing differ between a
    # cold and a warm engine. Alone in its batch, a request's numbers depend only on its KV.
    outs = []
    for i, p in enumerate(prompts):
        if BEFORE_PROMPT is not None:
            BEFORE_PROMPT(i)
        outs.append(llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0])
    result: dict[str, Any] = {"tokens": [], "logprobs": [], "num_cached": []}
    for out in outs:
        comp = out.outputs[0]
        result["tokens"].append(list(comp.token_ids))
        result["logprobs"].append([lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs)])
        result["num_cached"].append(out.num_cached_tokens or 0)
    if log_stats:
        llm.llm_engine.do_log_stats()  # the "KV Transfer metrics:" line of the interval
        result["metrics"] = tiercache_metrics(llm)
    # Shut the engine down here rather than in the interpreter's exit (vLLM's finalizers do the same
    # then): the connector sends its last stores, an engine-core or worker process exits, and
    # :func:`main` can then leave without the interpreter's teardown.
    llm.llm_engine.engine_core.shutdown()
    return result


def tiercache_metrics(llm: Any) -> dict[str, float]:
    """``{name[tier]: value}`` of the ``vllm:tiercache_*`` metrics (histograms: their count)."""
    from vllm.v1.metrics.reader import Counter, Histogram

    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:tiercache_"):
            continue
        name = m.name + (f"[{m.labels['tier']}]" if "tier" in m.labels else "")
        if isinstance(m, Counter):
            out[name] = out.get(name, 0) + m.value
        elif isinstance(m, Histogram):
            out[name + ".count"] = out.get(name + ".count", 0) + m.count
    return out


def launch(
    launcher: argparse.ArgumentParser, install: Callable[[argparse.Namespace], None], argv: list[str] | None
) -> None:
    """A test launcher's ``main``: parse its own options (``launcher``, ``add_help=False``), let
    ``install`` patch this process with them, then run :func:`main` on the rest of ``argv``."""
    args, rest = launcher.parse_known_args(sys.argv[1:] if argv is None else argv)
    install(args)
    main(rest)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--server", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--engine-args", default="{}", help="JSON object of LLM() keyword overrides")
    ap.add_argument(
        "--log-stats", action="store_true", help="run vLLM's stat loggers; report tiercache's metrics"
    )
    ap.add_argument("--connector-config", default="{}", help="JSON object added to kv_connector_extra_config")
    ap.add_argument("--kv-role", default="kv_both", help="the connector's kv_role")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    prompts = json.loads(Path(args.prompts).read_text())
    result = run(
        args.model,
        args.server,
        prompts,
        args.max_tokens,
        json.loads(args.engine_args),
        log_stats=args.log_stats,
        connector_config=json.loads(args.connector_config),
        kv_role=args.kv_role,
    )
    Path(args.out).write_text(json.dumps(result))
    # The engine is down (run() shut it down) and the result written: skip the interpreter's teardown
    # of torch and vLLM, ~2 s of every engine process on two cores. A run that raised never gets
    # here and exits as usual, with its traceback and a failing status.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
