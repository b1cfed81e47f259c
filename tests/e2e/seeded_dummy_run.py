"""Launcher: ``engine_run`` with ``load_format="dummy"`` weights drawn from a seed, by parameter name.

For models whose checkpoint names go through vLLM-specific remapping (fused experts, MLA's absorbed
projections, DeepSeek V4's hyper-connections, MiniMax M3's indexer) a hand-written safetensors file
would have to match names no transformers class produces reliably. Instead the engine builds the
model with vLLM's dummy loader and this launcher then overwrites every floating-point parameter with
seeded values, before vLLM's post-load processing (MLA weight absorption, expert repacking) runs:

* matrices ~N(0, 1/fan_in) (q/k projections 4x, the LM head 8x), embeddings ~N(0, 1), so attention
  is sharp and logits spread (vLLM's own dummy weights are U(-1e-3, 1e-3): flat logits that hide a
  wrong load);
* norm weights 1, other vectors (biases, routing biases) N(0, 0.02);
* recurrent decay parameters slow (``A_log`` = log U(0.01, 0.1), ``dt_bias`` = -4), so a state
  restored at a chunk boundary still matters tokens later.

Each parameter's generator is seeded with ``crc32(f"{seed}:{name}")``: values do not depend on the
order in which vLLM builds the layers. The seed is the model directory's ``seeded_dummy.json``
(``{"seed": N}``), written by :func:`write_seeded_dummy_model`; the launcher also sets the
connector's ``weights_id`` to the seed and the config's hash (there are no weight files for the
connector's content fingerprint), so other seeds are other weights to tiercache.

Usage (as ``engine_run``)::

    python -m tests.e2e.seeded_dummy_run --model DIR --server ... --prompts p.json --out o.json
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import zlib
from pathlib import Path
from typing import Any

SEED_FILE = "seeded_dummy.json"


def write_seeded_dummy_model(directory: Path, config: dict[str, Any], seed: int) -> None:
    """``config.json`` and the seed file; no weight files (the engine uses ``load_format="dummy"``)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    (directory / SEED_FILE).write_text(json.dumps({"seed": seed}))


def weights_id(model: Path) -> str:
    """What the connector is told the weights are: the seed and the config's bytes."""
    seed = json.loads((model / SEED_FILE).read_text())["seed"]
    digest = hashlib.sha256((model / "config.json").read_bytes()).hexdigest()[:16]
    return f"seeded-dummy:{seed}:{digest}"


def seeded_value(name: str, shape: tuple[int, ...], seed: int) -> Any:
    """The CPU float32 tensor the parameter ``name`` of ``shape`` gets (see the module docstring)."""
    import torch

    # torch's CPU generator (mt19937) keeps only the low 32 bits of its seed: mix seed and name into them.
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log" or name.endswith(".A_log"):
        return torch.log(torch.empty(shape).uniform_(0.01, 0.1, generator=g))
    if "dt_bias" in name:
        return torch.full(shape, -4.0)
    if len(shape) >= 2:
        if "embed" in name:
            return torch.randn(shape, generator=g)
        fan_in = shape[-1]
        scale = (
            8.0
            if "lm_head" in name
            else 4.0
            if any(
                s in name
                for s in ("q_proj", "k_proj", "qkv", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj")
            )
            else 1.0
        )
        return torch.randn(shape, generator=g) * (scale / math.sqrt(max(1, fan_in)))
    if "norm" in name:
        return torch.ones(shape)
    return torch.randn(shape, generator=g) * 0.02


def install(seed: int) -> None:
    """Make vLLM's dummy loader draw :func:`seeded_value` for every floating-point parameter."""
    import torch
    from vllm.model_executor.model_loader import dummy_loader

    original = dummy_loader.DummyModelLoader.load_weights

    def load_weights(self: Any, model: torch.nn.Module, model_config: Any) -> None:
        original(self, model, model_config)
        seeded = 0
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.device.type == "meta" or not torch.is_floating_point(param):
                    continue
                param.copy_(seeded_value(name, tuple(param.shape), seed).to(dtype=param.dtype))
                seeded += 1
        print(
            f"seeded_dummy_run: {seeded} parameters of {type(model).__name__} drawn from seed {seed}",
            file=sys.stderr,
            flush=True,
        )

    dummy_loader.DummyModelLoader.load_weights = load_weights  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    from tests.e2e import engine_run

    args = list(sys.argv[1:] if argv is None else argv)
    model = Path(args[args.index("--model") + 1])
    install(json.loads((model / SEED_FILE).read_text())["seed"])
    if "--connector-config" in args:
        at = args.index("--connector-config") + 1
        config = json.loads(args[at])
    else:
        at, config = -1, {}
    config.setdefault("weights_id", weights_id(model))
    if at < 0:
        args += ["--connector-config", json.dumps(config)]
    else:
        args[at] = json.dumps(config)
    engine_run.main(args)


if __name__ == "__main__":
    main()
