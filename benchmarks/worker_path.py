"""The connector worker's load and store path alone, against a plain copy of the same bytes.

The worker half (``tiercache.connector.worker.WorkerHalf``) against a real tiercache server in its
own process (ipc): a store is reserve → gather the chunk's pages from the KV tensors into the L1
arena slots, hashing them (the writer's digest) → commit; a load scatters the slots into other
blocks' pages, either from the slots the scheduler's lookup ticket pinned (named in the step's
metadata, as the connector loads a hit: no round trip) or, the fallback, pin by key → scatter →
release. Each load is timed twice: until its copies are done (what the forward pass waits for) and
until it is reported (its copies checked against their digests, which the worker does on another
thread during the forward pass; pins released). The KV
tensors have a vLLM 0.32 FlashAttention-style page layout (``[blocks, heads, block, K|V]`` per
layer, bf16), so each page is one contiguous run, as in a served engine.

The baseline, measured in the same run, call by call in turn with the paths: one plain copy of the same number of bytes between the KV
memory and a buffer (CPU: ``copy_`` between two host tensors, i.e. memcpy; CUDA: a pinned host
buffer to and from the device with ``non_blocking`` and a synchronize, the raw pinned copy). The
ratio is baseline time ÷ path time (1.00× is memcpy speed). Use ``--threads 1`` for what a
served CPU engine does (one compute thread per worker).

Needs torch and vLLM (the vLLM venv)::

    .venv-vllm/bin/python benchmarks/worker_path.py [--layers 16] [--chunks 4] [--iters 20] [--device cpu|cuda]

Only the CPU path has run here; ``--device cuda`` uses the worker's CUDA copy engine (the arena
registered with ``cudaHostRegister``, copies on its own stream) when a GPU is present.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 1 << 20


def _interleaved(
    fns: dict[str, Callable[[], None]], iters: int, sync: Callable[[], None]
) -> dict[str, float]:
    """Median seconds of each function, called in turn for each of ``iters`` rounds in a rotating
    order (a warm-up round first: first touches of the arena pages and the tensors), so a load on
    the shared cores that comes and goes weighs on the paths and the baseline alike."""
    names = list(fns)
    for name in names:
        fns[name]()
        sync()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(iters):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            t0 = time.perf_counter()
            fns[name]()
            sync()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in samples.items()}


def main(argv: list[str] | None = None) -> int:
    """Print the path's and the baseline's times and their ratios; 0, or 2 without torch/vLLM."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=16, help="tokens per vLLM block")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per tiercache chunk")
    ap.add_argument("--chunks", type=int, default=4, help="chunks stored and loaded per timed call")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads for both sides (0: torch's default)"
    )
    args = ap.parse_args(argv)
    try:
        import torch

        from tests.connector.fakes import link_to
        from tests.server.serverproc import ServerProcess, ServerSpec
        from tiercache.config.connector import ConnectorSettings
        from tiercache.connector.copy import CpuPageCopy, CudaPageCopy
        from tiercache.connector.layout import GroupLayout, verify_kv_caches
        from tiercache.connector.metadata import ChunkLoad, ChunkSave, RequestLoad, TierCacheMetadata
        from tiercache.connector.worker import WorkerHalf
        from tiercache.keys import GroupKind, LayoutManifest, ObjectKey, chunk_hashes
    except ImportError as exc:
        print(
            f"worker_path: needs torch and vLLM (run it with .venv-vllm/bin/python): {exc}", file=sys.stderr
        )
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("worker_path: --device cuda, but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    per_chunk = args.chunk // args.block
    page = args.heads * args.block * 2 * args.head_dim * 2  # bf16, K|V per head
    blocks = 2 * args.chunks * per_chunk + 1  # stored from one half, loaded into the other; 0 is null
    manifest = LayoutManifest(
        model_id="bench",
        model_revision="r",
        kv_dtype="bfloat16",
        attention_backend="FLASH_ATTN",
        kv_layout="LBHNC",
        kernel_block_size=args.block,
        manager_block_size=args.block,
        page_bytes=page,
        page_bytes_unpadded=page,
        group_kind=GroupKind.FULL_ATTENTION,
        chunk_size=args.chunk,
        num_layers=args.layers,
    )
    names = tuple(f"layer{i}" for i in range(args.layers))
    group = GroupLayout(0, 0, 0, names, args.block, per_chunk, page, manifest)
    caches = {
        n: torch.randn(blocks, args.heads, args.block, 2 * args.head_dim).to(torch.bfloat16).to(device)
        for n in names
    }
    nbytes = args.chunks * group.object_bytes
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # The baseline: the same bytes in one plain copy each way.
    baselines: dict[str, Callable[[], None]]
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

        def pinned_in() -> None:
            dev.copy_(host, non_blocking=True)

        def pinned_out() -> None:
            host.copy_(dev, non_blocking=True)

        baselines = {"base_in": pinned_in, "base_out": pinned_out}
        base = "raw pinned copy"
    else:
        a = torch.empty(nbytes, dtype=torch.uint8)
        b = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)

        def memcpy() -> None:
            a.copy_(b)

        baselines = {"base_in": memcpy}  # the same both ways
        base = "memcpy"

    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(
            ServerSpec(
                listen=f"ipc://{tmp}/s.sock",
                l1_bytes=3 * nbytes + 64 * MiB,
                options={"chunk_size": args.chunk},
            )
        )
        server.wait_ready()
        client = server.client(timeout=30.0)
        try:
            (ref,) = client.register([(0, manifest)])
            from tiercache.keys import Fingerprint

            copy = CudaPageCopy(device) if device.type == "cuda" else CpuPageCopy()
            if hasattr(copy, "attach"):
                copy.attach(client.arena())
            worker = WorkerHalf(None, None, ConnectorSettings(), link=link_to(client))
            worker.use_layout(
                [group], verify_kv_caches([group], caches, None), {0: Fingerprint(ref.fingerprint)}, copy
            )
            worker.order_layers(caches)
            hashes = chunk_hashes(list(range(args.chunks * args.chunk)), args.chunk)
            src = [list(range(1 + c * per_chunk, 1 + (c + 1) * per_chunk)) for c in range(args.chunks)]
            dst = [[b + args.chunks * per_chunk for b in ids] for ids in src]
            saves = [ChunkSave("bench", c, h, [src[c]]) for c, h in enumerate(hashes)]
            load_meta = [
                RequestLoad(
                    "bench", [ChunkLoad(h, [list(range(per_chunk))], [dst[c]]) for c, h in enumerate(hashes)]
                )
            ]
            step = [0]

            def store() -> None:
                worker._save_batch(saves)

            copied: dict[str, list[float]] = {"ticket": [], "pin": []}

            def load(meta: list[RequestLoad], path: str = "") -> None:
                step[0] += 1
                t0 = time.perf_counter()
                worker.start_load_kv(TierCacheMetadata(step=step[0], loads=meta))
                # What the forward pass waits for: the copies (their checks go on meanwhile).
                sync()
                if path:
                    copied[path].append(time.perf_counter() - t0)
                if worker.get_block_ids_with_load_errors():
                    raise RuntimeError("a chunk failed to load")

            store()  # what the loads read
            # The connector's hit: a lookup's ticket pins the chunks (outside the timing) and the
            # step's metadata names their slots, so the worker copies without a round trip.
            found = client.lookup(hashes, [ref], max_chunks=args.chunks)
            if found.ready_chunks != args.chunks:
                raise RuntimeError(f"the lookup pinned {found.ready_chunks} of {args.chunks} chunks")
            at = {ObjectKey.group_and_hash(s.key)[1]: (s.offset, s.nbytes, s.digest) for s in found.slots}
            ticket_meta = [
                RequestLoad(
                    "bench",
                    [
                        ChunkLoad(h, [list(range(per_chunk))], [dst[c]], slots=[(0, *at[h])])
                        for c, h in enumerate(hashes)
                    ],
                    arena=found.arena,
                )
            ]

            def load_from_ticket() -> None:
                # A step's load follows its lookup by one step: the worker trusts the slots only
                # while the ticket's leases surely hold (else it pins by key, which this would time).
                ticket_meta[0].leased_at = time.monotonic()
                load(ticket_meta, "ticket")

            t = _interleaved(
                {
                    "store": store,
                    "ticket": load_from_ticket,
                    "pin": lambda: load(load_meta, "pin"),
                    **baselines,
                },
                args.iters,
                sync,
            )
            # Each timed load, once more into cleared blocks: it must have moved every stored page,
            # and the ticket's must have pinned nothing (the worker falls back to a pin by key
            # without a word, and its row would then time the other path).
            src_ids = torch.tensor([b for ids in src for b in ids])
            dst_ids = torch.tensor([b for ids in dst for b in ids])
            for path, fn, pins in (
                ("ticket's slots", load_from_ticket, 0),
                ("pin by key", lambda: load(load_meta), 1),
            ):
                for kv in caches.values():
                    kv[dst_ids] = 0
                hits = client.stats()["tiers"]["l1"]["hits"]
                fn()
                sync()
                pinned = client.stats()["tiers"]["l1"]["hits"] - hits
                if pinned != pins * args.chunks:
                    raise RuntimeError(
                        f"the load from the {path} pinned {pinned} objects, not {pins * args.chunks}"
                    )
                for name, kv in caches.items():
                    if not torch.equal(kv[dst_ids], kv[src_ids]):
                        raise RuntimeError(
                            f"{name}: a page loaded from the {path} differs from the stored one"
                        )
            client.release_ticket(found.ticket, read=True)
        finally:
            client.close()
            server.stop()
    t_store, t_ticket, t_load = t["store"], t["ticket"], t["pin"]
    # The warm-up round's copy is not timed; the checks-off runs after the timing are not either.
    c_ticket = statistics.median(copied["ticket"][1 : args.iters + 1])
    c_load = statistics.median(copied["pin"][1 : args.iters + 1])
    t_base_in, t_base_out = t["base_in"], t.get("base_out", t["base_in"])
    gbs = nbytes / 1e9
    print(
        f"worker path on {device.type}: {args.chunks} chunks of {group.object_bytes / MiB:.1f} MiB "
        f"({args.layers} layers x {per_chunk} pages of {page // 1024} KiB), median of {args.iters}, "
        f"{torch.get_num_threads()} torch thread(s)"
    )
    print(f"| path | time | GB/s | {base} | ratio |")
    print("|---|---|---|---|---|")
    for label, t, tb in (
        ("store (KV -> arena), committed with its digest", t_store, t_base_out),
        ("load, the ticket's slots: copied (the forward pass may start)", c_ticket, t_base_in),
        ("load, the ticket's slots: copied and checked (reported)", t_ticket, t_base_in),
        ("load, pin by key: copied", c_load, t_base_in),
        ("load, pin by key: copied, checked and released (reported)", t_load, t_base_in),
    ):
        print(f"| {label} | {t * 1e3:.2f} ms | {gbs / t:.2f} | {tb * 1e3:.2f} ms | {tb / t:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
