"""Tier throughput against raw baselines measured in the same run (``tiercache bench``, ``benchmarks/tiers.py``).

For each chunk size, each tier's put and get throughput is measured next to the raw operation it is
built on, on the same bytes, on the same machine, interleaved round by round:

* L1 (shared arena): reserve → copy → commit / pin → copy out → release, in requests of ``BATCH``
  chunks as the server does, vs a numpy copy into / out of the very same arena pages.
* L2 (LMDB): ``DiskTier.put`` / ``DiskTier.read_into`` (copy into the caller's buffer, verified), vs
  raw ``lmdb`` puts and ``get(buffers=True)`` copies with the same environment settings and the same
  background ``env.sync()`` interval, one transaction per value. The tier checksums every byte both ways; raw lmdb checks nothing.
* L3 (S3): ``S3Tier.put`` / ``get``, vs raw boto3 ``put_object`` / ``get_object`` against the same
  endpoint with the same client settings and the same number of threads.

Each figure is the median of ``rounds`` timed rounds after one warm-up round; the ratio is what
matters (these machines are shared and noisy). Results go to stdout as a table and optionally JSON.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from tiercache.config.parts import DiskConfig, L1Config, S3Config
from tiercache.config.units import KiB, MiB, format_size
from tiercache.keys import Fingerprint, ObjectKey

if TYPE_CHECKING:  # imported where used: `tiercache bench` loads a tier only when it measures it
    from tiercache.l1.tier import L1Tier

DEFAULT_SIZES = (256 * KiB, 1 * MiB, 4 * MiB)
#: Told about each (tier, chunk size) case as it runs: ``progress(tier, chunk_bytes, phase)`` with
#: ``phase`` ``"start"`` or ``"done"``. Called on the caller's thread; the CLI draws a progress bar.
ProgressFn = Callable[[str, int, str], None]
#: One case's medians, GB/s: the tier's, then the raw baseline's.
_Pair = tuple[float, float]


def _no_progress(tier: str, chunk_bytes: int, phase: str) -> None:
    return None


#: Chunks per L1 request: a store or load request of a prompt carries many chunks, and the server
#: reserves/pins them in one call (one lock round trip per request, not per chunk).
BATCH = 16


@dataclass(frozen=True, slots=True)
class BenchRow:
    """One line of the result: a tier, an operation and a chunk size, with its baseline."""

    tier: str
    op: str
    chunk_bytes: int
    tier_gbps: float
    raw_gbps: float
    baseline: str

    @property
    def ratio(self) -> float:
        return self.tier_gbps / self.raw_gbps if self.raw_gbps else float("nan")

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "ratio": round(self.ratio, 3)}


def _keys(n: int, size: int) -> list[ObjectKey]:
    fp = Fingerprint(b"bench-fingerprnt")
    return [ObjectKey(fp, size % 0xFFFF, i.to_bytes(16, "big")) for i in range(n)]


def _page_aligned(size: int) -> np.ndarray:
    """A page-aligned destination buffer, as KV pages and arena slots are.

    A plain ``np.empty`` of 256 KiB is malloc'd from a fresh mapping at page + 16 bytes, where
    memcpy ran 2.8 GB/s against 12 GB/s page-aligned on this machine: whether a run got such a buffer
    depended on the heap's history, and the 256 KiB figures (both sides) moved with it.
    """
    raw = np.empty(size + 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start : start + size]


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _median_pair(
    tier_fn: Callable[[], object],
    raw_fn: Callable[[], object],
    nbytes: int,
    rounds: int,
    reset: Callable[[], None] | None = None,
) -> tuple[float, float]:
    """Warm both up once, then alternate timed rounds; medians in GB/s.

    ``reset`` (untimed) runs before every tier round, e.g. to empty the tier so each put round
    stores into free space as the raw baseline does.
    """
    tier_fn()
    raw_fn()
    tier_t: list[float] = []
    raw_t: list[float] = []
    for _ in range(rounds):
        for fn, out in ((tier_fn, tier_t), (raw_fn, raw_t)):
            if reset is not None and fn is tier_fn:
                reset()
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return _gbps(nbytes, statistics.median(tier_t)), _gbps(nbytes, statistics.median(raw_t))


def bench_l1(
    sizes: Sequence[int], total_bytes: int, rounds: int, progress: ProgressFn = _no_progress
) -> list[BenchRow]:
    """L1 put/get vs memcpy into/out of the very same arena memory.

    The baseline copies to and from the slots the tier itself uses (same physical pages), so what the
    ratio shows is the tier's own overhead, not which pages the VM handed out: measured against a
    second /dev/shm mapping, the same code gave anywhere from 0.70x to 1.28x from run to run.
    """
    rows: list[BenchRow] = []
    for size in sizes:
        progress("l1", size, "start")
        put, get = _bench_l1_size(size, total_bytes, rounds)
        rows.append(BenchRow("l1", f"put x{BATCH}", size, *put, "memcpy, same arena pages"))
        rows.append(BenchRow("l1", f"get x{BATCH}", size, *get, "memcpy, same arena pages"))
        progress("l1", size, "done")
    return rows


def _bench_l1_size(size: int, total_bytes: int, rounds: int) -> tuple[_Pair, _Pair]:
    """One chunk size of :func:`bench_l1`: the (tier, raw) GB/s of puts, then of gets."""
    from tiercache.l1.tier import L1Tier

    n = max(1, total_bytes // size)
    keys = _keys(n, size)
    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    dst = _page_aligned(size)
    tier = L1Tier(L1Config(size_bytes=n * size + 64 * MiB, name=f"tc-bench-{uuid.uuid4().hex[:8]}"))
    try:
        batches = [keys[i : i + BATCH] for i in range(0, n, BATCH)]

        def tier_put() -> None:
            for batch in batches:
                handles = tier.reserve_many([(key, size) for key in batch])
                for handle in handles:
                    np.copyto(np.frombuffer(handle.buffer, np.uint8), src)
                tier.commit_many(handles)

        def tier_get() -> None:
            for batch in batches:
                pinned = [h for h in tier.pin_many(batch) if h is not None]
                if len(pinned) != len(batch):
                    raise RuntimeError("the L1 bench lost objects it had stored")
                for handle in pinned:
                    np.copyto(dst, np.frombuffer(handle.buffer, np.uint8))
                tier.release_many(pinned)

        def empty() -> None:
            for key in keys:
                tier.delete(key)

        tier_put()  # places every slot; emptying and refilling reuses the same offsets
        slots = _arena_slots(tier, keys, size)

        def raw_put() -> None:
            for slot in slots:
                np.copyto(slot, src)

        def raw_get() -> None:
            for slot in slots:
                np.copyto(dst, slot)

        put = _median_pair(tier_put, raw_put, n * size, rounds, reset=empty)
        tier_put()
        get = _median_pair(tier_get, raw_get, n * size, rounds)
    finally:
        tier.close()
    return put, get


def _arena_slots(tier: L1Tier, keys: Sequence[ObjectKey], size: int) -> list[np.ndarray]:
    """Views of the arena pages that hold ``keys`` now: where the raw baseline copies to and from."""
    offsets: list[int] = []
    for key in keys:
        handle = tier.pin(key)
        if handle is None:
            raise RuntimeError("the L1 bench lost an object it had stored")
        offsets.append(tier.slot_of(handle).offset)
        tier.release(handle)
    arena = np.frombuffer(tier.arena.view(0, tier.config.size_bytes), np.uint8)
    return [arena[off : off + size] for off in offsets]


def _sync_every(env: object, interval: float, stop: threading.Event) -> None:
    while not stop.wait(interval):
        env.sync(True)  # type: ignore[attr-defined]  # an lmdb.Environment; lmdb is imported only to measure


@contextmanager
def _synced(env: object, interval: float) -> Iterator[None]:
    """Sync ``env`` every ``interval`` seconds in the background while the block runs.

    Same durability on both sides: the tier syncs LMDB every sync_interval_s in the background, so
    the raw baseline does too (unsynced, it would only fill the page cache).
    """
    stop = threading.Event()
    syncer = threading.Thread(
        target=_sync_every, args=(env, interval, stop), name="tiercache-bench-raw-sync", daemon=True
    )
    syncer.start()
    try:
        yield
    finally:
        stop.set()
        syncer.join()


def _open_raw_lmdb(path: Path, budget: int) -> Any:
    """The raw baseline's LMDB environment (``lmdb`` ships no types, hence ``Any``)."""
    import lmdb

    # The tier's own environment flags (tiercache/l2_disk/environment.py), so the ratio is the tier's work and not a
    # setting: meminit=False skips zeroing the unused tail of each value's pages.
    return lmdb.open(
        str(path),
        map_size=int(budget * 1.5) + 64 * MiB,
        sync=False,
        metasync=False,
        writemap=False,
        readahead=True,
        meminit=False,
    )


def bench_disk(
    sizes: Sequence[int],
    total_bytes: int,
    rounds: int,
    path: Path | None = None,
    progress: ProgressFn = _no_progress,
) -> list[BenchRow]:
    """L2 put/get vs raw lmdb on the same filesystem with the same environment settings, one value
    per transaction on both sides."""
    rows: list[BenchRow] = []
    base = Path(tempfile.mkdtemp(prefix="tiercache-bench-", dir=path))
    try:
        for size in sizes:
            progress("disk", size, "start")
            put, get = _bench_disk_size(base, size, total_bytes, rounds)
            rows.append(BenchRow("disk", "put", size, *put, "raw lmdb"))
            rows.append(BenchRow("disk", "get", size, *get, "raw lmdb"))
            progress("disk", size, "done")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return rows


def _bench_disk_size(base: Path, size: int, total_bytes: int, rounds: int) -> tuple[_Pair, _Pair]:
    """One chunk size of :func:`bench_disk`, under ``base``: the (tier, raw) GB/s of puts, then gets."""
    from tiercache.l2_disk import DiskTier

    n = max(1, total_bytes // size)
    keys = _keys(n, size)
    raw_keys = [k.to_bytes() for k in keys]
    src = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8)
    # The array itself goes to both puts, as a buffer (numpy's stubs declare the buffer
    # protocol only for Python >= 3.12); a cast, so that nothing is added to the timed loops.
    src_buf = cast(memoryview, src)
    dst = _page_aligned(size)
    budget = 4 * n * size
    tier = DiskTier(DiskConfig(path=base / f"tier-{size}", budget_bytes=budget))
    env = _open_raw_lmdb(base / f"raw-{size}", budget)
    try:
        with _synced(env, tier.config.sync_interval_s):

            def tier_put() -> None:
                for key in keys:
                    tier.put(key, src_buf)

            def raw_put() -> None:
                for k in raw_keys:
                    with env.begin(write=True) as txn:
                        txn.put(k, src_buf)

            dst_view = dst.data  # memoryview(dst), typed as one

            def tier_get() -> None:
                # read_into: what promotion into an L1 slot does (copy, verify in cache).
                for key in keys:
                    # Never inside an assert: ``python -O`` would strip the read being timed.
                    if tier.read_into(key, lambda n: dst_view[:n]) is None:
                        raise RuntimeError(f"the disk bench lost {key}")

            def raw_get() -> None:
                for k in raw_keys:
                    with env.begin(buffers=True) as txn:
                        np.copyto(dst, np.frombuffer(cast(memoryview, txn.get(k)), np.uint8))

            put = _median_pair(tier_put, raw_put, n * size, rounds)
            get = _median_pair(tier_get, raw_get, n * size, rounds)
    finally:
        tier.close()
        env.close()
    return put, get


def bench_s3(
    sizes: Sequence[int],
    total_bytes: int,
    rounds: int,
    config: S3Config,
    progress: ProgressFn = _no_progress,
) -> list[BenchRow]:
    """L3 put/get vs raw boto3 on the same endpoint, same client settings, same thread count."""
    from tiercache.l3_s3 import S3Tier

    rows: list[BenchRow] = []
    tier = S3Tier(config)
    client = tier.raw_client()
    threads = config.max_concurrency
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="tiercache-bench") as pool:
            for size in sizes:
                progress("s3", size, "start")
                n = max(threads, total_bytes // size)
                keys = _keys(n, size)
                names = [f"{config.prefix}/bench-raw/{k.text()}" for k in keys]
                body = np.random.default_rng(2).integers(0, 255, size, dtype=np.uint8).tobytes()

                def run(fn: Callable[[int], object]) -> Callable[[], object]:
                    return lambda: list(pool.map(fn, range(n)))

                def raw_get_one(i: int) -> None:
                    client.get_object(Bucket=config.bucket, Key=names[i])["Body"].read()

                def tier_get_one(i: int) -> None:
                    if tier.get(keys[i]) is None:  # not an assert: python -O would skip the GET
                        raise RuntimeError(f"the S3 bench lost {keys[i]}")

                put = _median_pair(
                    run(lambda i: tier.put(keys[i], body)),
                    run(lambda i: client.put_object(Bucket=config.bucket, Key=names[i], Body=body)),
                    n * size,
                    rounds,
                )
                get = _median_pair(run(tier_get_one), run(raw_get_one), n * size, rounds)
                rows.append(BenchRow("s3", "put", size, *put, "raw boto3"))
                rows.append(BenchRow("s3", "get", size, *get, "raw boto3"))
                progress("s3", size, "done")
    finally:
        tier.close()
    return rows


def render(rows: Sequence[BenchRow]) -> str:
    """A plain-text table (also what docs/benchmarks.md shows)."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    table = Table(title="tiercache tiers vs raw baselines (GB/s, median of rounds)")
    for col in ("tier", "op", "chunk", "tier GB/s", "raw GB/s", "ratio", "baseline"):
        table.add_column(col, justify="right" if "GB/s" in col or col == "ratio" else "left")
    for r in rows:
        table.add_row(
            r.tier,
            r.op,
            format_size(r.chunk_bytes),
            f"{r.tier_gbps:.2f}",
            f"{r.raw_gbps:.2f}",
            f"{r.ratio:.2f}x",
            r.baseline,
        )
    out = StringIO()
    Console(file=out, width=100, force_terminal=False).print(table)
    return out.getvalue()
