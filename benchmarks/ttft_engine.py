"""One fresh vLLM CPU engine for ``benchmarks/e2e_ttft.py``: time each prompt's first token.

Run by the benchmark as a script, one process per engine (a fresh engine = a fresh process, so vLLM's
own prefix cache starts empty and every hit must come from the connector under test)::

    PYTHON benchmarks/ttft_engine.py --spec spec.json --out result.json

It imports only the standard library and vLLM, so it runs unchanged in a venv without tiercache
(LMCache's). ``spec.json`` holds the model directory, the engine sizes, the ``kv_transfer_config``
(or ``null`` for no connector), the prompts and the warm-up prompt. ``result.json`` gets, per
prompt, the wall time of ``llm.generate`` with ``max_tokens=1``, the first token, its logprob and
``num_cached_tokens``; with ``"repeat": true`` each prompt is generated a second time right after
the first, which measures vLLM's own (in-process) prefix cache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20


def _env_for_engine(multiprocess: bool) -> None:
    """Environment that must be set before ``import vllm``."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # without it some configs stall ~15 s trying the hub
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    os.environ["LMCACHE_TRACK_USAGE"] = "false"  # LMCache reports usage by default
    # VLLM_CPU_KVCACHE_SPACE (whole GiB) would override kv_cache_memory_bytes.
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Start the engine described by ``spec``, time the prompts, return the measurements."""
    _env_for_engine(bool(spec.get("multiprocess", False)))
    t_import = time.perf_counter()
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except (ImportError, RuntimeError, OSError) as exc:  # e.g. CUDA torchvision: fail here, in one line
        raise SystemExit(
            f"error: cannot import vLLM with {sys.executable}: {type(exc).__name__}: {exc}"
        ) from None
    t_start = time.perf_counter()
    kwargs: dict[str, Any] = {}
    if spec["kv_transfer_config"] is not None:
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    llm = LLM(
        model=spec["model"],
        load_format="safetensors",
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        max_model_len=spec["max_model_len"],
        dtype=spec["dtype"],
        max_num_seqs=4,
        max_num_batched_tokens=spec["max_batched_tokens"],
        enforce_eager=True,  # torch.compile would add ~80 s per engine start on CPU
        block_size=spec["block_size"],
        distributed_executor_backend="uni",
        kv_cache_memory_bytes=spec["kv_cache_mib"] * MiB,
        seed=0,
        **kwargs,
    )
    t_ready = time.perf_counter()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=1)

    def one(ids: list[int]) -> dict[str, Any]:
        # One prompt per generate call: TTFT of a request alone in its batch, and logprobs that
        # depend only on its KV (CPU kernels are not batch-invariant).
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        comp = out.outputs[0]
        tok = comp.token_ids[0]
        return {
            "ttft_s": dt,
            "token": tok,
            "logprob": comp.logprobs[0][tok].logprob,
            "num_cached": out.num_cached_tokens or 0,
        }

    # The warm-up prompt shares no block with the measured ones: it pays one-off costs (first
    # forward, connector connections, lazy arena attach) outside the measurement.
    warm = one(spec["warmup"])
    prompts: list[dict[str, Any]] = []
    for ids in spec["prompts"]:
        rec = one(ids)
        if spec.get("repeat"):
            rec["repeat"] = one(ids)
        prompts.append(rec)
    # A last tiny request gives connectors one more engine step to report finished stores before
    # the process exits (tiercache keeps a finished request's blocks until its chunks are stored).
    one(spec["warmup"][: spec["block_size"]])
    return {
        "python": sys.executable,
        "import_s": t_start - t_import,
        "engine_start_s": t_ready - t_start,
        "warmup": warm,
        "prompts": prompts,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description="Time first tokens on one fresh vLLM CPU engine (used by e2e_ttft.py)."
    )
    ap.add_argument("--spec", required=True, type=Path, help="JSON engine spec written by e2e_ttft.py")
    ap.add_argument("--out", required=True, type=Path, help="where to write the JSON result")
    args = ap.parse_args()
    result = run(json.loads(args.spec.read_text()))
    args.out.write_text(json.dumps(result))
    # Normal interpreter exit on purpose: connectors finish queued stores in their shutdown hooks.


if __name__ == "__main__":
    main()
