"""Time to first token on a real vLLM CPU engine: tiercache against recompute and peer KV caches.

For one prompt set (default: 4128-token prompts on a tiny seeded-weight Llama, hidden 512, 8 layers,
head_dim 64, float32, block 32, chunk 256) it measures, per system:

* **cold TTFT**: first engine process, nothing cached anywhere;
* **hit TTFT**: a *fresh* engine process on the same prompts, so vLLM's own prefix cache is empty
  and every cached token must come from the connector (its server or its files).

Systems: recompute (no connector; the same process then repeats each prompt, which measures vLLM's
own in-process prefix cache as a reference), tiercache (``tiercache server --tiers l1,disk`` started
here; hits from L1, and, after a server restart, from the disk tier), vLLM's ExampleConnector
(safetensors files on disk) and LMCache's multiprocess server with shared memory (when ``lmcache``
imports in ``--python``: every system's engines and servers start from that one interpreter, since
venvs with different package versions prefill at different speeds; LMCache needs ``--multiprocess``).

TTFT is the wall time of ``llm.generate`` with ``max_tokens=1`` for one prompt, after engine start
and a warm-up prompt that shares no block with the measured prompts; medians over prompts and rounds.
Each hit is also checked against the same system's cold run: the first token must be equal and the
max |logprob difference| is reported (seeded random weights make outputs depend on the KV); the JSON
also has the difference against the recompute run.

The table goes to stdout, progress to stderr. Run from the repo root with the vLLM venv::

    .venv-serve/bin/python benchmarks/e2e_ttft.py --prompts 3 --rounds 1 --multiprocess --json ttft.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tiercache and the helpers from the checkout

from benchmarks.common import (  # noqa: E402
    add_pin_arguments,
    engine_env,
    lmcache_server_argv,
    pinned,
    placement,
    progress,
    stop_process,
    tiercache_server_argv,
    tiercache_stats,
    wait_for_port,
    wait_for_tiercache,
)

ENGINE_SCRIPT = Path(__file__).resolve().with_name("ttft_engine.py")
MiB = 1 << 20


log = progress("e2e_ttft")


# -- model and prompts ---------------------------------------------------------------------------


def write_llama(directory: Path, args: argparse.Namespace) -> None:
    """A Llama checkpoint with seeded random weights (``model.safetensors``), so the first token and
    its logprob depend on the KV: vLLM's dummy weights give flat logits that hide a wrong load."""
    # Imported here: the module's own imports stay the standard library's (and the helpers').
    from tiercache.testing.checkpoints import tiny_llama_config, write_tiny_checkpoint

    cfg = tiny_llama_config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=max_model_len(args),
        torch_dtype=args.dtype,
    )
    write_tiny_checkpoint(directory, cfg, args.seed)


def make_prompts(args: argparse.Namespace, rnd: int) -> tuple[list[list[int]], list[int]]:
    """``args.prompts`` random prompts for round ``rnd`` (new ones each round, so a round's cold run
    is really cold for servers that outlive a round) and a warm-up prompt that shares no block with
    them (its first token differs from every prompt's)."""
    rng = random.Random(args.seed * 1000 + rnd)
    prompts = [[rng.randrange(3, args.vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    firsts = {p[0] for p in prompts}
    warm = [rng.randrange(3, args.vocab) for _ in range(args.warmup_len)]
    warm[0] = next(t for t in range(3, args.vocab) if t not in firsts)
    return prompts, warm


def max_model_len(args: argparse.Namespace) -> int:
    need = max(args.prompt_len, args.warmup_len) + 1
    return -(-need // args.block_size) * args.block_size


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[args.dtype]
    return 2 * args.layers * args.kv_heads * args.head_dim * itemsize


def kv_cache_mib(args: argparse.Namespace) -> int:
    """Room for every prompt of a round plus the warm-up, so the in-process repeat (vLLM's own prefix
    cache) still finds its blocks; ``--kv-cache-mib`` overrides."""
    if args.kv_cache_mib:
        return args.kv_cache_mib
    tokens = args.prompts * args.prompt_len + 2 * args.warmup_len
    return int(tokens * kv_bytes_per_token(args) * 1.25 / MiB) + 32


# -- servers -------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class TierCacheServer:
    """``tiercache server --tiers l1,disk`` in a subprocess, on a socket and a disk dir under ``root``."""

    python: str
    root: Path
    chunk: int
    l1_gb: float
    tiers: str = "l1,disk"
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    cpus: str | None = None  # taskset's CPU list (placement())

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.root}/server.sock"

    def start(self) -> None:
        self.starts += 1
        log = self.root / f"server-{self.starts}.log"
        disk = self.root / "disk" if "disk" in self.tiers.split(",") else None
        cmd = tiercache_server_argv(self.python, self.endpoint, self.chunk, self.l1_gb, disk)
        with log.open("wb") as logf:
            self.proc = subprocess.Popen(
                pinned(cmd, self.cpus), stdout=logf, stderr=subprocess.STDOUT, cwd=REPO
            )
        wait_for_tiercache(self.proc, self.endpoint, log)

    def stats(self) -> dict[str, Any]:
        return tiercache_stats(self.endpoint)

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None

    def kv_transfer_config(self, **extra: Any) -> dict[str, Any]:
        return {
            "kv_connector": "TierCacheConnector",
            "kv_connector_module_path": "tiercache.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"server": self.endpoint, "timeout_s": 5.0, **extra},
        }


@dataclass
class LMCacheServer:
    """``lmcache server`` (multiprocess mode, shared-memory transport) from ``--python``'s venv."""

    python: str
    root: Path
    chunk: int
    l1_gb: float
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    cpus: str | None = None  # taskset's CPU list (placement())

    def start(self) -> None:
        cmd = lmcache_server_argv(
            self.python, self.chunk, self.l1_gb, self.port, f"lmc_ttft_{os.getpid()}", None
        )
        log = self.root / "lmcache-server.log"
        with log.open("wb") as logf:
            self.proc = subprocess.Popen(
                pinned(cmd, self.cpus),
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, LMCACHE_TRACK_USAGE="false"),
                cwd=self.root,
            )
        wait_for_port(self.proc, self.port, log)

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None

    def kv_transfer_config(self) -> dict[str, Any]:
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": self.port},
        }


# -- engine processes ----------------------------------------------------------------------------


def run_engine(
    args: argparse.Namespace,
    work: Path,
    name: str,
    python: str,
    ktc: dict[str, Any] | None,
    prompts: list[list[int]],
    warm: list[int],
    *,
    repeat: bool = False,
    multiprocess: bool | None = None,
) -> dict[str, Any]:
    """One fresh engine process: returns ``ttft_engine.py``'s result."""
    spec = {
        "model": str(work / "model"),
        "dtype": args.dtype,
        "block_size": args.block_size,
        "max_model_len": max_model_len(args),
        "max_batched_tokens": args.max_batched_tokens or max_model_len(args),
        "kv_cache_mib": kv_cache_mib(args),
        "multiprocess": args.multiprocess if multiprocess is None else multiprocess,
        "kv_transfer_config": ktc,
        "prompts": prompts,
        "warmup": warm,
        "repeat": repeat,
    }
    spec_path, out_path, log_path = (
        work / f"{name}.spec.json",
        work / f"{name}.out.json",
        work / f"{name}.log",
    )
    spec_path.write_text(json.dumps(spec))
    t0 = time.perf_counter()
    with log_path.open("wb") as logf:
        try:
            rc = subprocess.run(
                pinned(
                    [python, str(ENGINE_SCRIPT), "--spec", str(spec_path), "--out", str(out_path)],
                    args.engine_pin,
                ),
                env=os.environ | engine_env(args.engine_cpus),
                check=False,
                stdout=logf,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                timeout=args.engine_timeout_s,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    if rc != 0 or not out_path.exists():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
        raise RuntimeError(
            f"engine '{name}' failed (rc={rc}); last lines of {log_path}:\n  " + "\n  ".join(tail)
        )
    res = json.loads(out_path.read_text())
    ttfts = [p["ttft_s"] * 1e3 for p in res["prompts"]]
    log(
        f"{name}: import {res['import_s']:.1f} s, engine start {res['engine_start_s']:.1f} s, "
        f"TTFT ms {[round(t) for t in ttfts]}, cached {[p['num_cached'] for p in res['prompts']]}, "
        f"process {time.perf_counter() - t0:.0f} s"
    )
    return res


# -- results -------------------------------------------------------------------------------------


@dataclass
class Row:
    """One system's samples across prompts and rounds."""

    system: str
    note: str
    cold: list[dict[str, Any]] = field(default_factory=list)
    hit: list[dict[str, Any]] = field(default_factory=list)
    #: the same system's cold record for the prompt of each hit sample (correctness: hit == cold)
    ref: list[dict[str, Any]] = field(default_factory=list)
    #: the recompute run's record for the prompt of each hit sample
    base: list[dict[str, Any]] = field(default_factory=list)
    #: the row whose cold median is this system's no-connector baseline (same venv, same packages)
    baseline: str = "recompute"


def med_ms(samples: list[dict[str, Any]]) -> float | None:
    return statistics.median(s["ttft_s"] for s in samples) * 1e3 if samples else None


def summarise(rows: dict[str, Row]) -> list[dict[str, Any]]:
    out = []
    for r in rows.values():
        recompute = med_ms(rows[r.baseline].cold)
        cold, hit = med_ms(r.cold), med_ms(r.hit)
        diffs = [abs(h["logprob"] - ref["logprob"]) for h, ref in zip(r.hit, r.ref)]
        diffs_base = [abs(h["logprob"] - b["logprob"]) for h, b in zip(r.hit, r.base)]
        same = sum(h["token"] == ref["token"] for h, ref in zip(r.hit, r.ref))
        cached = [h["num_cached"] for h in r.hit]
        out.append(
            {
                "system": r.system,
                "note": r.note,
                "cold_ttft_ms": cold,
                "hit_ttft_ms": hit,
                "speedup": cold / hit if cold and hit else None,
                # The cold-run cost of storing: this system's cold TTFT over the connector-less one.
                "cold_vs_recompute": cold / recompute if cold and recompute else None,
                "hit_vs_recompute": hit / recompute if hit and recompute else None,
                "cached_tokens": cached,
                "tokens_equal": f"{same}/{len(r.hit)}" if r.hit else None,
                "max_abs_dlogprob": max(diffs) if diffs else None,
                "max_abs_dlogprob_vs_recompute": max(diffs_base) if diffs_base else None,
                "cold_ttft_ms_samples": [s["ttft_s"] * 1e3 for s in r.cold],
                "hit_ttft_ms_samples": [s["ttft_s"] * 1e3 for s in r.hit],
            }
        )
    return out


def fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "–" if v is None else f"{v:{spec}}{suffix}"


def table(summary: list[dict[str, Any]]) -> str:
    lines = [
        "| system | cold TTFT ms | cold / recompute | hit TTFT ms | speed-up (cold/hit) | hit / recompute | cached tokens (hit) | first token = cold | max \\|Δlogprob\\| vs cold |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        cached = s["cached_tokens"]
        cached_s = (
            "–"
            if not cached
            else (str(cached[0]) if min(cached) == max(cached) else f"{min(cached)}–{max(cached)}")
        )
        lines.append(
            f"| {s['system']} | {fmt(s['cold_ttft_ms'], '.0f')} | {fmt(s['cold_vs_recompute'], '.2f')} | {fmt(s['hit_ttft_ms'], '.0f')} | "
            f"{fmt(s['speedup'], '.1f', '×')} | {fmt(s['hit_vs_recompute'], '.3f')} | {cached_s} | "
            f"{s['tokens_equal'] or '–'} | {fmt(s['max_abs_dlogprob'], '.1e')} |"
        )
    return "\n".join(lines)


@dataclass
class RoundCtx:
    """What one round's cold/hit pairs share: its prompts and its recompute run."""

    args: argparse.Namespace
    work: Path
    rnd: int
    prompts: list[list[int]]
    warm: list[int]
    base: dict[str, Any]
    rows: dict[str, Row]
    failures: list[str]

    def pair(self, key: str, python: str, ktc: dict[str, Any], *, multiprocess: bool = False) -> None:
        """A cold engine, then a fresh engine on the same prompts; a failure is recorded, not fatal."""
        kw = {"multiprocess": True} if multiprocess else {}
        try:
            cold = run_engine(
                self.args, self.work, f"r{self.rnd}-{key}-cold", python, ktc, self.prompts, self.warm, **kw
            )
            hit = run_engine(
                self.args, self.work, f"r{self.rnd}-{key}-hit", python, ktc, self.prompts, self.warm, **kw
            )
        except RuntimeError as exc:
            log(str(exc))
            self.failures.append(f"{key} round {self.rnd + 1}: {str(exc).splitlines()[0]}")
            return
        self.rows[key].cold += cold["prompts"]
        self.rows[key].hit += hit["prompts"]
        self.rows[key].ref += cold["prompts"]
        self.rows[key].base += self.base["prompts"]

    def hit_only(self, key: str, of: str, ktc: dict[str, Any]) -> None:
        """A fresh engine on the prompts row ``of``'s cold run stored (compared with that cold run)."""
        n = len(self.prompts)
        try:
            hit = run_engine(
                self.args, self.work, f"r{self.rnd}-{key}", self.args.python, ktc, self.prompts, self.warm
            )
        except RuntimeError as exc:
            log(str(exc))
            self.failures.append(f"{key} round {self.rnd + 1}: {str(exc).splitlines()[0]}")
            return
        self.rows[key].cold += self.rows[of].cold[-n:]
        self.rows[key].hit += hit["prompts"]
        self.rows[key].ref += self.rows[of].cold[-n:]
        self.rows[key].base += self.base["prompts"]


def add_recompute(rows: dict[str, Row], res: dict[str, Any]) -> None:
    """Samples of a no-connector engine: its first pass is the recompute baseline, its in-process
    repeat of each prompt measures vLLM's own prefix cache."""
    rows["recompute"].cold += res["prompts"]
    rows["local"].cold += res["prompts"]
    rows["local"].hit += [p["repeat"] for p in res["prompts"]]
    rows["local"].ref += res["prompts"]
    rows["local"].base += res["prompts"]


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=(
            "Time to first token (TTFT) on a real vLLM CPU engine: cold (nothing cached) and hit (a fresh "
            "engine process, so hits come from the connector) for recompute, vLLM's own prefix cache, "
            "tiercache, vLLM's ExampleConnector and LMCache MP. Table on stdout, progress on stderr."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = ap.add_argument_group("workload")
    g.add_argument("--prompts", type=int, default=2, help="distinct prompts per round")
    g.add_argument(
        "--prompt-len",
        type=int,
        default=4128,
        help="tokens per prompt; the default is 16 chunks of 256 plus one block, so every system "
        "can hit the same 4096 tokens and recomputes the same last block",
    )
    g.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat everything with new prompts and fresh engine processes; medians over all",
    )
    g.add_argument(
        "--warmup-len",
        type=int,
        default=512,
        help="tokens of the warm-up prompt run after engine start (shares no block with the prompts)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the model weights and the prompts")
    m = ap.add_argument_group("model (tiny Llama, seeded random weights)")
    m.add_argument("--hidden", type=int, default=512, help="hidden size (MLP is 2× this)")
    m.add_argument("--layers", type=int, default=8, help="decoder layers")
    m.add_argument("--heads", type=int, default=8, help="attention (query) heads")
    m.add_argument("--kv-heads", type=int, default=4, help="KV heads")
    m.add_argument(
        "--head-dim", type=int, default=64, help="head size (CPU backend: 32, 64, 80, 96, 112, 128, ...)"
    )
    m.add_argument("--vocab", type=int, default=1024, help="vocabulary size")
    m.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="model and KV dtype")
    e = ap.add_argument_group("engine")
    e.add_argument("--block-size", type=int, default=32, help="vLLM block size (multiple of 32 on CPU)")
    e.add_argument("--chunk-size", type=int, default=256, help="tiercache and LMCache chunk size in tokens")
    e.add_argument(
        "--max-batched-tokens",
        type=int,
        default=0,
        help="vLLM max_num_batched_tokens (prefill step size; 0: the whole prompt in one step). "
        "vLLM's ExampleConnector needs the whole prompt in one step: with chunked prefill it "
        "saves only the first step's KV and its hit engine dies with a shape mismatch",
    )
    e.add_argument(
        "--kv-cache-mib",
        type=int,
        default=0,
        help="vLLM KV cache size in MiB (0: enough for one round's prompts)",
    )
    e.add_argument(
        "--multiprocess",
        action="store_true",
        help="vLLM's multiprocess engine (EngineCore + worker processes, as `vllm serve`) instead of "
        "in-process; needed for the LMCache row (vLLM 0.32's in-process engine fails to start with "
        "its connector), and then every system runs it",
    )
    e.add_argument(
        "--engine-timeout-s", type=float, default=600.0, help="kill an engine process after this long"
    )
    e.add_argument(
        "--engine-cpus",
        default="0",
        help="the CPUs every engine computes on, whatever the system (VLLM_CPU_OMP_THREADS_BIND); "
        "'auto' leaves vLLM to choose, which gives an engine with a connector more compute threads",
    )
    add_pin_arguments(e)
    s = ap.add_argument_group("systems")
    s.add_argument(
        "--systems",
        default="tiercache,example,lmcache",
        help="comma list of systems besides the recompute baseline (always run): tiercache, example, "
        "lmcache; also tiercache-inline: a second tiercache hit with overlap_loads=false (loads "
        "written before the forward pass instead of layer by layer during it)",
    )
    s.add_argument(
        "--no-bracket",
        action="store_true",
        help="run the recompute baseline only at the start of each round, not also at its end",
    )
    s.add_argument(
        "--no-disk-hit",
        action="store_true",
        help="skip the tiercache row that restarts the server and hits from the disk tier",
    )
    s.add_argument(
        "--python",
        default=sys.executable,
        help="the one interpreter every engine and cache server starts from: a venv with vllm-cpu, "
        "tiercache and, for the LMCache row, lmcache (docs/benchmarks.md, 'One install')",
    )
    s.add_argument("--lmcache-python", default=None, help=argparse.SUPPRESS)  # gone: refused in main()
    s.add_argument(
        "--l1-size-gb", type=float, default=1.0, help="L1 size of the tiercache and LMCache servers"
    )
    s.add_argument(
        "--tiercache-tiers",
        default="l1,disk",
        choices=["l1,disk", "l1"],
        metavar="{l1,disk | l1}",
        help="the tiercache server's tiers; l1 alone is like-for-like with LMCache's server (memory "
        "only) for the cold-run store cost, and implies --no-disk-hit",
    )
    o = ap.add_argument_group("output")
    o.add_argument(
        "--json", type=Path, default=None, help="also write the summary and every sample to this file"
    )
    o.add_argument(
        "--keep", action="store_true", help="keep the temporary directory (engine logs, specs, server logs)"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Absolute, but not resolved: a venv's python is a symlink whose target would lose the venv.
    args.python = os.path.abspath(args.python)
    if args.lmcache_python is not None:
        print(
            "error: --lmcache-python is gone: LMCache from a venv of its own compared that venv's vLLM "
            "with tiercache's. Install lmcache next to tiercache and pass that venv's python as --python "
            "(docs/benchmarks.md, 'One install')",
            file=sys.stderr,
        )
        return 2
    for mod in ("vllm", "torch", "safetensors", "transformers"):
        if importlib.util.find_spec(mod) is None:
            print(
                f"error: {mod} is not importable with {sys.executable}; run with the vLLM venv "
                f"(e.g. .venv-vllm/bin/python benchmarks/e2e_ttft.py)",
                file=sys.stderr,
            )
            return 2
    systems = [x.strip() for x in args.systems.split(",") if x.strip()]
    unknown = set(systems) - {"tiercache", "tiercache-inline", "example", "lmcache"}
    if unknown:
        print(f"error: unknown --systems {sorted(unknown)}", file=sys.stderr)
        return 2
    if args.chunk_size % args.block_size:
        print(
            f"error: --chunk-size {args.chunk_size} must be a multiple of --block-size {args.block_size}",
            file=sys.stderr,
        )
        return 2
    if "tiercache-inline" in systems and "tiercache" not in systems:
        systems.insert(systems.index("tiercache-inline"), "tiercache")  # its cold run stores the chunks
    if args.tiercache_tiers == "l1":
        args.no_disk_hit = True  # no disk tier to hit from
    skipped: list[str] = []
    try:
        args.engine_pin, args.cache_pin = placement(args.engine_cpus, args.pin)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if "lmcache" in systems and not args.multiprocess:
        print(
            "error: LMCache runs only on vLLM's multiprocess engine (vLLM 0.32's in-process engine fails to "
            "start with its connector): pass --multiprocess, so that every system runs the same engine",
            file=sys.stderr,
        )
        return 2
    if (
        "lmcache" in systems
        and subprocess.run([args.python, "-c", "import lmcache"], capture_output=True).returncode
    ):
        systems.remove("lmcache")
        skipped.append(f"LMCache MP: skipped (lmcache does not import with --python {args.python})")

    work = Path(tempfile.mkdtemp(prefix="e2e_ttft-"))
    log(
        f"work dir {work}; {args.prompts} prompts × {args.prompt_len} tokens × {args.rounds} round(s); "
        f"KV {kv_bytes_per_token(args) * args.prompt_len / MiB:.0f} MiB per prompt; systems: recompute, {', '.join(systems)}"
    )
    write_llama(work / "model", args)

    rows = {
        "recompute": Row("recompute (no connector)", "cold run; every request recomputes"),
        "local": Row("vLLM prefix cache (same process)", "reference: the cold process repeats each prompt"),
    }
    if "tiercache" in systems:
        rows["tiercache"] = Row("tiercache (L1 hit)", f"server --tiers {args.tiercache_tiers}; fresh engine")
        if "tiercache-inline" in systems:
            rows["tiercache_inline"] = Row("tiercache (L1 hit, loads not overlapped)", "overlap_loads=false")
        if not args.no_disk_hit:
            rows["tiercache_disk"] = Row(
                "tiercache (disk hit, server restarted)", "L1 empty, chunks promoted from LMDB"
            )
    if "example" in systems:
        rows["example"] = Row("vLLM ExampleConnector", "safetensors files on local disk")
    if "lmcache" in systems:
        rows["lmcache"] = Row("LMCache MP (shared memory)", "lmcache server, engine_driven shm")

    tc = (
        TierCacheServer(
            args.python,
            work / "tiercache",
            args.chunk_size,
            args.l1_size_gb,
            args.tiercache_tiers,
            cpus=args.cache_pin,
        )
        if "tiercache" in systems
        else None
    )
    lmc = None
    if "lmcache" in systems:
        lmc = LMCacheServer(
            args.python, work / "lmcache", args.chunk_size, args.l1_size_gb, cpus=args.cache_pin
        )
    server_stats: list[dict[str, Any]] = []
    failures: list[str] = []
    try:
        for srv in (tc, lmc):
            if srv is not None:
                srv.root.mkdir(parents=True)
                srv.start()
        for rnd in range(args.rounds):
            prompts, warm = make_prompts(args, rnd)
            log(f"round {rnd + 1}/{args.rounds}")
            base = run_engine(args, work, f"r{rnd}-recompute", args.python, None, prompts, warm, repeat=True)
            add_recompute(rows, base)

            rd = RoundCtx(args, work, rnd, prompts, warm, base, rows, failures)
            if tc is not None:
                rd.pair("tiercache", args.python, tc.kv_transfer_config())
                server_stats.append({"round": rnd, "after": "tiercache hit", "stats": tc.stats()})
                if "tiercache-inline" in systems:
                    rd.hit_only("tiercache_inline", "tiercache", tc.kv_transfer_config(overlap_loads=False))
                if not args.no_disk_hit:
                    tc.stop()
                    tc.start()  # same disk dir, empty L1: hits must be promoted from the disk tier
                    rd.hit_only("tiercache_disk", "tiercache", tc.kv_transfer_config())
                    server_stats.append({"round": rnd, "after": "tiercache disk hit", "stats": tc.stats()})
            if "example" in systems:
                store = work / "example-store"
                store.mkdir(exist_ok=True)
                rd.pair(
                    "example",
                    args.python,
                    {
                        "kv_connector": "ExampleConnector",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"shared_storage_path": str(store)},
                    },
                )
            if lmc is not None:
                rd.pair("lmcache", args.python, lmc.kv_transfer_config())  # --multiprocess (checked)
            if not args.no_bracket:
                # Recompute again at the end of the round: on a shared machine the load drifts over
                # the minutes a round takes, and the baseline should not be measured at one moment only.
                add_recompute(
                    rows,
                    run_engine(
                        args, work, f"r{rnd}-recompute-end", args.python, None, prompts, warm, repeat=True
                    ),
                )
    finally:
        for srv in (tc, lmc):
            if srv is not None:
                srv.stop()

    summary = summarise(rows)
    print(
        f"TTFT, {args.prompts} prompt(s) × {args.rounds} round(s), {args.prompt_len}-token prompts, "
        f"{args.layers} layers, hidden {args.hidden}, head_dim {args.head_dim}, {args.kv_heads} KV heads, {args.dtype}, "
        f"block {args.block_size}, chunk {args.chunk_size}, {'multiprocess' if args.multiprocess else 'in-process'} engine; "
        f"engine CPUs {args.engine_cpus}"
        + (
            f" (engine processes on {args.engine_pin}, cache servers on {args.cache_pin})"
            if args.cache_pin
            else ""
        )
        + "; "
        "medians; hit = fresh engine process\n"
    )
    print(table(summary))
    for line in skipped + [f"FAILED: {f}" for f in failures]:
        print(f"\n{line}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "kv_cache_mib": kv_cache_mib(args),
                    "summary": summary,
                    "skipped": skipped,
                    "failures": failures,
                    "tiercache_server_stats": server_stats,
                    "samples": {k: {"cold": r.cold, "hit": r.hit} for k, r in rows.items()},
                },
                indent=1,
                default=str,
            )
        )
        log(f"wrote {args.json}")
    if args.keep:
        log(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
