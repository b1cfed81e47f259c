"""SGLang HiCache storage: tiercache's backend against SGLang's own ``HiCacheFile`` and a plain copy.

One run, one host pool of SGLang's MHA layout (``layer_first``: a page is 2 × layers strided runs),
batches of ``--batch`` pages (SGLang's controller moves at most 128 per call), medians over
``--iters`` batches, and for each:

* ``plain copy``: the same pages copied out of the host pool into one contiguous buffer, and back
  (``torch`` ``copy_``): the floor any backend pays to move the bytes once;
* ``tiercache``: ``batch_set_v1`` (reserve → copy into the L1 arena → commit, the server in its own
  process with an LMDB disk tier); ``batch_get_v1`` of L1 hits; ``batch_get_v1`` of disk hits (a
  new server process on the same LMDB directory: L1 empty, every page promoted from disk);
  ``batch_exists`` of a batch of hits (one round trip); the L1 gets run once the disk tier has
  written every stored page (the write-behind would otherwise share the cores with them);
* ``HiCacheFile``: SGLang's file backend on the same disk (its v2 calls, one file per page),
  ``batch_exists``. Both disk paths read through the OS page cache: the pages were just written.

The gets that the ratios compare (plain copy, tiercache L1 hits, ``HiCacheFile``) run in turn, call
by call, and so do the two ``batch_exists``: on shared cores a load that comes and goes then weighs
on each alike. Prints GB/s, µs per ``batch_exists`` and the ratios the issue sets targets for (tiercache L1 get ≥
0.8× the plain copy, tiercache get ≥ 2× HiCacheFile get). Needs sglang (run it with
``.venv-sglang/bin/python benchmarks/sglang_storage.py``).

    python benchmarks/sglang_storage.py [--batch 128] [--iters 8] [--layers 4] [--dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# The server process and the host pool come from the test helpers (run from a checkout).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def median_s(fn: Callable[[int], object], iters: int) -> float:
    """Median seconds of ``fn(i)`` over ``iters`` calls (one warm-up call, index -1)."""
    fn(-1)
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved(fns: dict[str, Callable[[int], object]], iters: int) -> dict[str, float]:
    """Median seconds of each ``fns[name](i)``, the functions called in turn for each ``i`` (a
    warm-up round first, index -1) and in a rotating order, so none always runs first."""
    names = list(fns)
    for name in names:
        fns[name](-1)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(iters):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            t0 = time.perf_counter()
            fns[name](i)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batch", type=int, default=128, help="pages per call (default 128, SGLang's STORAGE_BATCH_SIZE)"
    )
    parser.add_argument("--iters", type=int, default=8, help="timed batches per measurement (default 8)")
    parser.add_argument("--layers", type=int, default=4, help="layers per page (default 4)")
    parser.add_argument(
        "--dir", type=Path, default=None, help="where the disk tier and files go (default: a temp dir)"
    )
    args = parser.parse_args()
    try:
        import torch
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolName, PoolTransfer
    except ImportError:
        print("sglang_storage: sglang is not installed; run it with .venv-sglang/bin/python (skipped)")
        return 0
    from tests.server.serverproc import ServerSpec
    from tests.sglang.hostpool import MHALayoutHostPool
    from tests.sglang.setup import backend, keys, running, storage_config
    from tiercache.testing.poll import wait_until
    from tiercache.wire.client import Client

    torch.set_num_threads(1)  # SGLang's storage threads copy on one thread each
    page_size, heads, head_dim = 64, 8, 128
    batch, iters = args.batch, args.iters
    rounds = iters + 1  # the warm-up batch, then the timed ones
    pool = MHALayoutHostPool(
        2 * batch, page_size=page_size, layer_num=args.layers, head_num=heads, head_dim=head_dim
    )
    for p in range(2 * batch):
        pool.fill(p, seed=p)
    page_bytes = len(pool.page_bytes(0))
    batch_bytes = page_bytes * batch
    src = pool.indices(list(range(batch)))
    dst = pool.indices(list(range(batch, 2 * batch)))
    print(
        f"pages of {page_bytes / 2**20:.2f} MiB ({args.layers} layers, {page_size} tokens, {heads} heads × "
        f"{head_dim}, bf16, layer_first), {batch} per call, median of {iters} calls"
    )

    def gbps(seconds: float) -> float:
        return batch_bytes / seconds / 1e9

    # The floor: every page copied once out of the pool and once back in.
    flat = torch.empty(batch, page_bytes // 2, dtype=torch.bfloat16)

    def plain_out(_: int) -> None:
        for i in range(batch):
            flat[i].view(pool.get_data_page(i * page_size, flat=False).shape).copy_(
                pool.get_data_page(i * page_size, flat=False)
            )

    def plain_in(_: int) -> None:
        for i in range(batch):
            page = pool.get_data_page((batch + i) * page_size, flat=False)
            page.copy_(flat[i].view(page.shape))

    plain_set = median_s(plain_out, iters)

    def file_backend() -> HiCacheFile:
        cfg = storage_config("ipc:///unused")
        cfg.extra_config = {"file_storage_path": str(root / "hicache-file")}
        hf = HiCacheFile(cfg)
        hf.register_mem_host_pool_v2(pool, PoolName.KV)
        return hf

    def file_set(hf: HiCacheFile, i: int) -> None:
        done = hf.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=src, keys=names[i + 1])])
        assert all(done[PoolName.KV])

    def file_get(hf: HiCacheFile, i: int) -> None:
        done = hf.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=dst, keys=names[i + 1])])
        assert all(done[PoolName.KV])

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        spec = ServerSpec(
            listen=f"ipc://{root}/server.sock",
            l1_bytes=batch_bytes * (rounds + 2),
            disk_path=str(root / "l2"),
            disk_budget=batch_bytes * (rounds + 4) * 2,
            options={"chunk_size": page_size},
        )
        names = [keys(batch, f"r{r}") for r in range(rounds)]
        with running(spec) as server:
            tc = backend(server.endpoint, pool)
            try:
                tc_set = median_s(lambda i: tc.batch_set_v1(names[i + 1], src), iters)
                # The gets below are measured with the disk idle: the write-behind of those stores
                # (LMDB, checksums) would otherwise share the 2 cores with them.
                with Client(server.endpoint) as watcher:
                    wait_until(
                        lambda: watcher.stats()["tiers"]["disk"]["objects"] >= rounds * batch,
                        timeout=600,
                        what="the stores reached the disk",
                    )
                assert tc.batch_get_v1(names[0], dst) == [True] * batch, "tiercache lost a stored page"
                # The three gets (and the two batch_exists) in turn, call by call: a load that comes
                # and goes on the shared cores then weighs on each alike, and the ratios compare
                # calls made under the same load.
                hf = file_backend()
                f_set = median_s(lambda i: file_set(hf, i), iters)
                gets = interleaved(
                    {
                        "plain": plain_in,
                        "tc": lambda i: tc.batch_get_v1(names[i + 1], dst),
                        "file": lambda i: file_get(hf, i),
                    },
                    iters,
                )
                plain_get, tc_get_l1, f_get = gets["plain"], gets["tc"], gets["file"]
                exists = interleaved(
                    {
                        "tc": lambda i: tc.batch_exists(names[i + 1]),
                        "file": lambda i: hf.batch_exists(names[i + 1]),
                    },
                    iters,
                )
                tc_exists, f_exists = exists["tc"], exists["file"]
            finally:
                tc.close()
        with running(spec) as server:
            tc = backend(server.endpoint, pool)
            try:
                # Each batch once: it is on disk only, and the read promotes it into L1.
                tc_get_disk = median_s(lambda i: tc.batch_get_v1(names[i + 1], dst), iters)
                got = tc.batch_get_v1(names[0], dst)
                assert got == [True] * batch, f"disk hits: {sum(got)} of {batch}"
            finally:
                tc.close()

    rows = [
        ("plain copy", plain_set, plain_get, None),
        ("tiercache, L1 hits", tc_set, tc_get_l1, tc_exists),
        ("tiercache, disk hits", None, tc_get_disk, None),
        ("SGLang HiCacheFile", f_set, f_get, f_exists),
    ]
    print(f"{'':24} {'set GB/s':>9} {'get GB/s':>9} {'exists µs':>10}")
    for name, s, g, e in rows:
        cells = [f"{gbps(v):9.2f}" if v else f"{'-':>9}" for v in (s, g)]
        cells.append(f"{e * 1e6:10.0f}" if e else f"{'-':>10}")
        print(f"{name:24} {' '.join(cells)}")
    print(
        f"ratios: tiercache L1 get / plain copy {plain_get / tc_get_l1:.2f}x (target >= 0.8), "
        f"set {plain_set / tc_set:.2f}x; tiercache get / HiCacheFile get: L1 {f_get / tc_get_l1:.2f}x, "
        f"disk {f_get / tc_get_disk:.2f}x (target >= 2); set {f_set / tc_set:.2f}x; "
        f"batch_exists {f_exists / tc_exists:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
