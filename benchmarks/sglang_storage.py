"""SGLang HiCache storage: tiercache's backend against SGLang's own ``HiCacheFile`` and a plain copy.

One run, one host pool of SGLang's MHA layout (``layer_first``: a page is 2 × layers strided runs),
batches of ``--batch`` pages (SGLang's controller moves at most 128 per call), medians over
``--iters`` batches, and for each:

* ``plain copy``: the same pages copied out of the host pool into one contiguous buffer, and back
  (``torch`` ``copy_``): the floor any backend pays to move the bytes once; and the copy back split
  over one thread per core (``plain copy, N threads``): the most this machine moves into the pool,
  which bounds what any backend's get can reach;
* ``tiercache``: ``batch_set_v1`` (reserve → copy into the L1 arena → commit, the server in its own
  process with an LMDB disk tier); ``batch_exists`` then ``batch_get_v1`` of the same pages, as
  SGLang's controller calls them (the get copies from the slots the exists' lookup pinned), each
  part timed, for L1 hits and for disk hits (a new server process on the same LMDB directory: L1
  empty, every page promoted from disk; measured once it has mapped its arena ahead); and ``batch_get_v1`` of L1 hits with no exists before it
  (it pins them itself: one round trip more). The L1 calls run once the disk tier has written every
  stored page (the write-behind would otherwise share the cores with them);
* ``HiCacheFile``: SGLang's file backend on the same disk (its v2 calls, one file per page),
  ``batch_exists`` then the get. Both disk paths read through the OS page cache: the pages were
  just written.

The calls that the ratios compare (plain copy, tiercache L1 hits, ``HiCacheFile``) run in turn,
call by call: on shared cores a load that comes and goes then weighs on each alike. Prints GB/s,
µs per ``batch_exists`` and the ratios the issue sets targets for (tiercache L1 get ≥ 0.8× the
plain copy, tiercache get ≥ 2× HiCacheFile get). Needs sglang (run it with
``.venv-sglang/bin/python benchmarks/sglang_storage.py``).

    python benchmarks/sglang_storage.py [--batch 128] [--iters 8] [--layers 4] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
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


Parts = Mapping[str, float]


Samples = dict[str, dict[str, list[float]]]


def interleaved(fns: dict[str, Callable[[int], Parts | None]], iters: int) -> Samples:
    """Seconds of each ``fns[name](i)`` for ``i`` in ``range(iters)`` (``[name][part][i]``), the
    functions called in turn for each ``i`` (a warm-up round first, index -1) and in a rotating
    order, so none always runs first. A function that returns ``None`` is timed whole (part
    ``"call"``); one that times its own parts returns them (seconds by part name), and their sum is
    part ``"call"`` too."""
    names = list(fns)
    for name in names:
        fns[name](-1)
    times: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for i in range(iters):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            t0 = time.perf_counter()
            parts = fns[name](i)
            whole = time.perf_counter() - t0
            measured = dict(parts) if parts is not None else {}
            measured["call"] = sum(measured.values()) if parts is not None else whole
            for part, seconds in measured.items():
                times[name].setdefault(part, []).append(seconds)
    return times


def medians(samples: Samples) -> dict[str, dict[str, float]]:
    """The median of each function's each part."""
    return {name: {part: statistics.median(t) for part, t in by.items()} for name, by in samples.items()}


def paired(slower: list[float], faster: list[float]) -> float:
    """The median over rounds of ``slower[i] / faster[i]``: two calls of one round ran within
    milliseconds of each other, so a load on the shared cores that comes and goes between rounds
    weighs on both sides of each ratio."""
    return statistics.median(a / b for a, b in zip(slower, faster, strict=True))


def timed_parts(**calls: Callable[[], object]) -> dict[str, float]:
    """Call each of ``calls`` in order; the seconds each took, by its name."""
    out: dict[str, float] = {}
    for name, call in calls.items():
        t0 = time.perf_counter()
        call()
        out[name] = time.perf_counter() - t0
    return out


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
    parser.add_argument(
        "--each",
        action="store_true",
        help="also print every round's milliseconds of the interleaved L1 calls",
    )
    args = parser.parse_args()
    try:
        import torch
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorage, PoolName, PoolTransfer
    except ImportError:
        print("sglang_storage: sglang is not installed; run it with .venv-sglang/bin/python (skipped)")
        return 0
    from tests.server.serverproc import ServerSpec
    from tests.sglang.hostpool import MHALayoutHostPool
    from tests.sglang.setup import backend, keys, running, storage_config
    from tiercache.client.client import Client
    from tiercache.testing.poll import wait_until

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

    # The floor: every page copied once out of the pool and once back in. Each round has a buffer
    # of its own, as each has arena slots of its own: a get reads bytes that were written a while
    # ago, and so does the plain copy (reading one buffer again and again would find more of it in
    # the caches than any cache's read does).
    flats = [torch.empty(batch, page_bytes // 2, dtype=torch.bfloat16) for _ in range(rounds)]

    def plain_out(r: int) -> None:
        for i in range(batch):
            flats[r + 1][i].view(pool.get_data_page(i * page_size, flat=False).shape).copy_(
                pool.get_data_page(i * page_size, flat=False)
            )

    def plain_in(r: int, flat: list[torch.Tensor] | None = None, pages: range = range(batch)) -> None:
        for i in pages:
            page = pool.get_data_page((batch + i) * page_size, flat=False)
            page.copy_((flat or flats)[r + 1][i].view(page.shape))

    # The ceiling: the same copy, its pages split over one thread per core (torch lets go of the
    # GIL in copy_), from buffers of its own (written before, as plain_out wrote the others).
    cores = os.cpu_count() or 1
    copiers = ThreadPoolExecutor(cores)

    def plain_all(r: int) -> None:
        shares = [range(batch * k // cores, batch * (k + 1) // cores) for k in range(cores)]
        for done in [copiers.submit(plain_in, r, flats_all, share) for share in shares]:
            done.result()

    plain_set = median_s(plain_out, iters)
    flats_all = [flat.clone() for flat in flats]

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

    def exists_get(b: HiCacheStorage, get: Callable[[], object], i: int) -> dict[str, float]:
        """SGLang's prefetch of one batch: ``batch_exists``, then the get of the pages it found."""

        def exists() -> None:
            assert b.batch_exists(names[i + 1]) == batch

        return timed_parts(exists=exists, get=get)

    def tc_get(b: HiCacheStorage, i: int, which: list[list[str]] | None = None) -> None:
        assert b.batch_get_v1((which or names)[i + 1], dst) == [True] * batch

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        spec = ServerSpec(
            listen=f"ipc://{root}/server.sock",
            l1_bytes=batch_bytes * (2 * rounds + 2),
            disk_path=str(root / "l2"),
            disk_budget=batch_bytes * (2 * rounds + 4) * 2,
            options={"chunk_size": page_size},
        )
        names = [keys(batch, f"r{r}") for r in range(rounds)]
        # Pages of their own for the gets without an exists: the first read of a slot after a while
        # costs more than the next, and each get must be that first read.
        alone = [keys(batch, f"a{r}") for r in range(rounds)]
        with running(spec) as server:
            tc = backend(server.endpoint, pool)
            try:
                with Client(server.endpoint) as watcher:

                    def on_disk(pages: int) -> None:
                        # Untimed, after each set: the disk tier's write-behind queue is bounded and
                        # drops what does not fit (counted), and every page must reach the disk for
                        # the disk-hit gets; it also keeps the writes off the cores of what follows.
                        wait_until(
                            lambda: watcher.stats()["tiers"]["disk"]["objects"] >= pages,
                            timeout=600,
                            what=f"{pages} pages reached the disk",
                        )

                    def set_round(i: int) -> dict[str, float]:
                        parts = timed_parts(set=lambda: tc.batch_set_v1(names[i + 1], src))
                        on_disk((i + 2) * batch)
                        return parts

                    tc_set = statistics.median(interleaved({"tc set": set_round}, iters)["tc set"]["set"])
                    for r, batch_keys in enumerate(alone):
                        assert tc.batch_set_v1(batch_keys, src) == [True] * batch
                        on_disk((rounds + r + 1) * batch)
                assert tc.batch_get_v1(names[0], dst) == [True] * batch, "tiercache lost a stored page"
                # The three gets (and the two batch_exists) in turn, call by call: a load that comes
                # and goes on the shared cores then weighs on each alike, and the ratios compare
                # calls made under the same load.
                hf = file_backend()
                f_set = median_s(lambda i: file_set(hf, i), iters)
                rounds_l1 = interleaved(
                    {
                        "plain": plain_in,
                        "plain all": plain_all,
                        "tc": lambda i: exists_get(tc, lambda: tc_get(tc, i), i),
                        "tc alone": lambda i: tc_get(tc, i, alone),
                        "file": lambda i: exists_get(hf, lambda: file_get(hf, i), i),
                    },
                    iters,
                )
            finally:
                tc.close()
        copiers.shutdown()
        with running(spec) as server:
            tc = backend(server.endpoint, pool)
            # Settle: the fresh server and this client map the arena ahead on background threads
            # (about 3 GB/s each here); disk hits are measured on a server up a moment, not on one
            # whose every promotion still faults its arena's pages in.
            assert tc.batch_exists(alone[0][:1]) == 1
            time.sleep(1 + spec.l1_bytes / 1e9)
            try:
                # Each batch once: it is on disk only, and the exists' lookup promotes it into L1.
                disk = interleaved({"tc disk": lambda i: exists_get(tc, lambda: tc_get(tc, i), i)}, iters)
                assert tc.batch_get_v1(names[0], dst) == [True] * batch, "a disk hit was lost"
            finally:
                tc.close()
    got = medians(rounds_l1) | medians(disk)
    if args.each:
        for name, parts in rounds_l1.items():
            for part, seconds in parts.items():
                print(f"{name:>9} {part:>6} ms: {' '.join(f'{1e3 * t:6.1f}' for t in seconds)}")

    # name, set seconds, the calls' parts (exists, get, both).
    rows: list[tuple[str, float | None, dict[str, float]]] = [
        ("plain copy", plain_set, {"get": got["plain"]["call"]}),
        (f"plain copy, {cores} threads", None, {"get": got["plain all"]["call"]}),
        ("tiercache, L1 hits", tc_set, got["tc"]),
        ("tiercache, L1, get alone", None, {"get": got["tc alone"]["call"]}),
        ("tiercache, disk hits", None, got["tc disk"]),
        ("SGLang HiCacheFile", f_set, got["file"]),
    ]
    print(f"{'':26} {'set GB/s':>9} {'get GB/s':>9} {'exists µs':>10} {'exists+get GB/s':>16}")
    for name, s, parts in rows:
        exists_s = parts.get("exists")
        cells = [f"{gbps(v):9.2f}" if v else f"{'-':>9}" for v in (s, parts.get("get"))]
        cells.append(f"{exists_s * 1e6:10.0f}" if exists_s else f"{'-':>10}")
        cells.append(f"{gbps(parts['call']):16.2f}" if exists_s else f"{'-':>16}")
        print(f"{name:26} {' '.join(cells)}")
    # The L1 ratios pair the calls of each round (they ran in turn); the disk hits ran on another
    # server, minutes later, so theirs are ratios of medians.
    plain, plain_cores, tc_l1, alone, file = (
        rounds_l1[n] for n in ("plain", "plain all", "tc", "tc alone", "file")
    )
    tc_disk = got["tc disk"]
    print(
        f"ratios (L1: median over rounds of each round's ratio): tiercache L1 get / plain copy "
        f"{paired(plain['call'], tc_l1['get']):.2f}x (target >= 0.8; get alone "
        f"{paired(plain['call'], alone['call']):.2f}x); tiercache get / HiCacheFile get: "
        f"L1 {paired(file['get'], tc_l1['get']):.2f}x, disk {got['file']['get'] / tc_disk['get']:.2f}x "
        f"(target >= 2); exists+get: L1 {paired(file['call'], tc_l1['call']):.2f}x, "
        f"disk {got['file']['call'] / tc_disk['call']:.2f}x; batch_exists {paired(file['exists'], tc_l1['exists']):.2f}x; "
        f"set: plain / tiercache {plain_set / tc_set:.2f}x, HiCacheFile / tiercache {f_set / tc_set:.2f}x"
    )
    print(
        f"ceiling: the plain copy on {cores} threads moved {paired(file['get'], plain_cores['call']):.2f}x "
        f"HiCacheFile's get rate (a get at 2x HiCacheFile needs more than that, a copy at "
        f"{2 / paired(file['get'], plain_cores['call']):.2f}x this machine's ceiling) and "
        f"{paired(plain['call'], plain_cores['call']):.2f}x the plain copy on one thread"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
