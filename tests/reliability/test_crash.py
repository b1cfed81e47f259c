"""Scenario: kill -9 of the server during heavy concurrent writes, then a restart; and a client
(worker) killed mid-store.

Invariants after the server's kill and restart on the same LMDB directory and ipc socket: the server
starts (LMDB opens consistent, the stale socket is replaced); every chunk the disk tier listed before
the kill is a hit with the right bytes; a reservation that was filled but never committed is not
visible; zero wrong reads over every key any writer tried. For the killed client: its reservations
expire after the heartbeat timeout and the arena space comes back.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

from tests.reliability.common import figures, payload, unlink_arena
from tests.server.conftest import StartServer, manifest
from tiercache.errors import ServerError, TierCacheError
from tiercache.keys import ObjectKey
from tiercache.testing.poll import wait_until

KiB = 1 << 10
MiB = 1 << 20
CHUNK_BYTES = 16 * KiB
FP = manifest().fingerprint()


def key(writer: int, i: int) -> ObjectKey:
    return ObjectKey(FP, 0, writer.to_bytes(4, "big") + i.to_bytes(12, "big"))


def all_disk_keys(client) -> set[ObjectKey]:  # type: ignore[no-untyped-def]
    keys: set[ObjectKey] = set()
    cursor = b""
    while True:
        page, cursor = client.list_keys(tier="disk", cursor=cursor, limit=10000)
        keys.update(ObjectKey.from_bytes(k.key) for k in page)
        if not cursor:
            return keys


def test_kill_9_during_concurrent_writes_then_restart(start_server: StartServer, tmp_path: Path) -> None:
    disk = str(tmp_path / "disk")
    listen = f"ipc://{tmp_path}/crash/server.sock"
    spec = dict(l1_bytes=64 * MiB, disk_path=disk, disk_budget=512 * MiB, listen=listen)
    server = start_server(**spec)
    writers = 4
    attempted: list[set[ObjectKey]] = [set() for _ in range(writers)]
    stop = threading.Event()

    def write(w: int) -> None:
        try:
            with server.client(timeout=2.0) as c:
                c.register([(0, manifest())])
                i = 0
                while not stop.is_set():
                    batch = [key(w, i + j) for j in range(4)]
                    attempted[w].update(batch)
                    c.store_chunks(batch, [payload(k, CHUNK_BYTES) for k in batch])
                    i += 4
        except (TierCacheError, OSError):
            pass  # the server died under us: expected

    with server.client() as observer:
        arena = observer.server.arena_name
        observer.register([(0, manifest())])
        # A reservation filled with the right bytes but never committed: must never become visible.
        uncommitted = [key(99, i) for i in range(8)]
        slots = observer.reserve([(k, CHUNK_BYTES) for k in uncommitted])
        view = observer.arena()
        for k, s in zip(uncommitted, slots):
            assert s is not None
            view.view(s.offset, s.nbytes)[:] = payload(k, CHUNK_BYTES)
        threads = [threading.Thread(target=write, args=(w,), name=f"writer-{w}") for w in range(writers)]
        for t in threads:
            t.start()
        wait_until(
            lambda: observer.stats()["engine"]["l2_writes"] >= 600, timeout=60, what="600 chunks on disk"
        )
        on_disk = all_disk_keys(observer)  # committed and written to L2 before the kill
        os.kill(server.process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        stop.set()
        for t in threads:
            t.join(30)
    server.process.join(10)
    unlink_arena(arena)
    tried = set().union(*attempted)

    restarted = start_server(**spec)
    restart_s = time.monotonic() - killed_at
    hits = wrong = lost = 0
    with restarted.client() as c:
        c.register([(0, manifest())])
        after = all_disk_keys(c)
        for k in tried:
            got = c.get(k)
            if got is None:
                lost += k in on_disk
            elif got == payload(k, CHUNK_BYTES):
                hits += 1
            else:
                wrong += 1
        visible_uncommitted = [k for k in uncommitted if c.get(k) is not None or k in after]
        stats = c.stats()
    figures(
        "crash-kill-9",
        writers=writers,
        chunks_tried=len(tried),
        on_disk_before_kill=len(on_disk),
        hits_after_restart=hits,
        lost_committed=lost,
        wrong_reads=wrong,
        uncommitted_visible=len(visible_uncommitted),
        verify_failures=stats["tiers"]["disk"]["verify_failures"],
        kill_to_ready_s=restart_s,
    )
    assert wrong == 0
    assert lost == 0
    assert hits >= len(on_disk)
    assert visible_uncommitted == []


def _worker_killed_mid_store(endpoint: str, ready: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    """A worker that reserves, copies half its chunks, and then hangs until it is killed."""
    from tiercache.client.client import Client

    client = Client(endpoint, timeout=10.0)
    keys = [ObjectKey(FP, 0, b"K" * 12 + i.to_bytes(4, "big")) for i in range(16)]
    slots = client.reserve([(k, 256 * KiB) for k in keys])
    arena = client.arena()
    for s in slots[:8]:
        assert s is not None
        arena.view(s.offset, s.nbytes)[:] = b"\xab" * s.nbytes
    ready.set()
    time.sleep(600)


def test_a_client_killed_mid_store_loses_its_reservations_and_the_space_returns(
    start_server: StartServer,
) -> None:
    # A killed client's reservations are dropped with its session and their slots kept out of use
    # for the quarantine (it could be stalled, not dead, and write late): a second here.
    # (Its clients reserve most of the arena at once: the per-client bound is lifted.)
    server = start_server(
        l1_bytes=8 * MiB,
        options={"heartbeat_timeout_s": 0.5, "max_reserved_share_per_client": 1.0},
        l1_options={"quarantine_s": 1.0},
    )
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    worker = ctx.Process(target=_worker_killed_mid_store, args=(server.endpoint, ready), daemon=True)
    worker.start()
    try:
        assert ready.wait(60)
        with server.client() as watcher:
            held = watcher.stats()
            assert held["server"]["reservations"] == 16
            assert held["tiers"]["l1"]["bytes_used"] >= 4 * MiB
            os.kill(worker.pid, signal.SIGKILL)  # type: ignore[arg-type]
            worker.join(10)
            killed = time.monotonic()
            wait_until(
                lambda: watcher.stats()["server"]["reservations"] == 0,
                timeout=30,
                what="reservations to expire",
            )
            wait_until(
                lambda: watcher.stats()["tiers"]["l1"]["quarantine_bytes"] == 0,
                timeout=30,
                what="their slots' quarantine to end",
            )
            reclaim_s = time.monotonic() - killed
            after = watcher.stats()
            # The space is really back: the whole arena can be reserved again (and then stored into).
            keys = [ObjectKey(FP, 0, b"N" * 12 + i.to_bytes(4, "big")) for i in range(28)]
            try:
                stored = watcher.store_chunks(keys, [payload(k, 256 * KiB) for k in keys])
            except ServerError as exc:
                raise AssertionError(f"arena space did not come back: {exc}") from exc
            loaded = watcher.load_chunks(keys)
    finally:
        if worker.is_alive():
            worker.kill()
    wrong = sum(1 for k, v in zip(keys, loaded) if v != payload(k, 256 * KiB))
    figures(
        "client-killed-mid-store",
        reservations_held=held["server"]["reservations"],
        bytes_held=held["tiers"]["l1"]["bytes_used"],
        bytes_after_expiry=after["tiers"]["l1"]["bytes_used"],
        clients_expired=after["server"]["clients_expired"],
        reclaim_s=reclaim_s,
        restored_chunks=stored,
        wrong_reads=wrong,
    )
    assert after["tiers"]["l1"]["bytes_used"] == 0
    assert stored == len(keys) and wrong == 0
