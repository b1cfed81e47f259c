"""The worker half (:mod:`tiercache.connector.worker`) loading for recurrent layouts, against a fake
arena and server client: the state object lands in the block vLLM assigned at the hit's boundary,
asynchronous loads are reported once (failed as a whole when a chunk fails, even with nothing to
copy), a synchronous load reports its failed chunks' blocks; and the connector's sleep-mode hooks
(:mod:`tiercache.connector.connector`), which drain the worker's loads and queued stores.
(Kernel-split pages and the store path: ``test_worker_pages``.)

Needs torch and vLLM (the metadata derives from vLLM's); skipped elsewhere."""

from __future__ import annotations

import inspect
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import TypeVar

import pytest

pytest.importorskip("torch", reason="the worker half needs torch")
pytest.importorskip("vllm", reason="the worker half's metadata types come from vLLM")

import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from tests.connector.fakes import FakeLink, link_to, scheduler_half
from tiercache.config.connector import ConnectorSettings
from tiercache.connector import connector, scheduler, worker
from tiercache.connector.connector import TierCacheConnector
from tiercache.connector.copy import CpuPageCopy
from tiercache.connector.layout import GroupLayout
from tiercache.connector.metadata import ChunkLoad, RequestLoad, TierCacheMetadata
from tiercache.connector.pages import page_view
from tiercache.connector.scheduler import SchedulerHalf
from tiercache.connector.worker import WorkerHalf
from tiercache.keys import Fingerprint
from tiercache.keys.digest import digest
from tiercache.testing.poll import wait_until
from tiercache.wire import protocol as p

T = TypeVar("T")


class _FakeArena:
    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.buf)[offset : offset + nbytes]


class _PinClient:
    """The worker's server client for loads: pins the first ``len(keys)`` of ``slots`` in ``arena``,
    one arena (the "server" never restarts)."""

    lease_window_s = 100.0

    def __init__(self, arena: _FakeArena, slots: list[p.Slot]) -> None:
        self._arena, self._slots = arena, slots

    def pin(self, keys: Sequence[object], timeout: float | None = None) -> list[p.Slot]:
        return self._slots[: len(keys)]

    def arena(self) -> _FakeArena:
        return self._arena

    def in_session(self, call: Callable[[], T]) -> tuple[T, _FakeArena]:
        return call(), self._arena

    def clock(self) -> float:
        return time.monotonic()

    def release_leases_later(self, tokens: Sequence[int]) -> None:
        pass  # every lease was held for the whole copy

    def report_corrupt(self, slots: Sequence[p.Slot]) -> None:
        pass


def _recurrent_worker(
    slot_bytes: list[int], *, overlap: bool = True, dense: bool = False
) -> tuple[WorkerHalf, dict[int, torch.Tensor]]:
    """A WorkerHalf with kv group 0 full attention (2 blocks per chunk, 16-byte pages) and kv group 1
    recurrent (8-byte state pages; left out if ``dense``), 10 blocks each, all 0xEE; its fake client
    pins one slot per key with the given sizes, each slot's bytes filled with its index + 1. Returns
    the worker and the KV cache it writes, by kv group (one layer each, one row per block)."""
    arena = _FakeArena(sum(slot_bytes))
    offsets = [sum(slot_bytes[:i]) for i in range(len(slot_bytes))]
    for i, (off, n) in enumerate(zip(offsets, slot_bytes)):
        arena.buf[off : off + n] = bytes([i + 1]) * n
    slots = [
        p.Slot(b"", o, n, i + 1, digest(arena.view(o, n)))
        for i, (o, n) in enumerate(zip(offsets, slot_bytes))
    ]
    settings = ConnectorSettings(overlap_loads=overlap)
    w = WorkerHalf(None, None, settings, link=link_to(_PinClient(arena, slots)))
    kv = {0: torch.full((10, 16), 0xEE, dtype=torch.uint8), 1: torch.full((10, 8), 0xEE, dtype=torch.uint8)}
    groups = [
        GroupLayout(0, 0, 0, ("attn",), 384, 2, 16, None),  # type: ignore[arg-type]
        GroupLayout(1, 1, 0, ("gdn",), 384, 1, 8, None, recurrent=True),  # type: ignore[arg-type]
    ]
    pages = {
        0: [page_view("attn", kv[0], page_bytes=16, kernel_blocks=1)],
        1: [page_view("gdn", kv[1], page_bytes=8, kernel_blocks=1)],
    }
    if dense:
        groups, pages = groups[:1], {0: pages[0]}
    w.use_layout(groups, pages, {0: Fingerprint(b"\0" * 16), 1: Fingerprint(b"\1" * 16)}, CpuPageCopy())
    w.order_layers(["attn", "gdn"])
    return w, kv


def _reported(w: WorkerHalf) -> tuple[set[str], set[str], set[str]]:
    """The first non-empty ``transfer_results`` (an asynchronous load is written in the background
    and reported at the end of the first step after its writes are done)."""

    def reported() -> tuple[set[str], set[str], set[str]] | None:
        result = w.transfer_results(set())
        return result if any(result) else None

    result = wait_until(reported, timeout=10, interval=0.001, what="the load's report")
    assert result is not None  # (wait_until returns only a truthy result)
    return result


def _two_chunk_hit(asynchronous: bool = True) -> TierCacheMetadata:
    return TierCacheMetadata(
        step=1,
        loads=[
            RequestLoad(
                "r",
                [
                    ChunkLoad(b"0" * 16, [[0, 1], []], [[1, 2], []]),
                    ChunkLoad(b"1" * 16, [[0, 1], [0]], [[3, 4], [7]], state=True),
                ],
                asynchronous=asynchronous,
            )
        ],
    )


def test_the_state_object_lands_in_the_boundary_block_once_per_step() -> None:
    # Keys in order: chunk 0 attention, chunk 1 attention, chunk 1 state.
    w, kv = _recurrent_worker([32, 32, 8])
    meta = _two_chunk_hit()
    w.handle_preemptions(meta)
    w.start_load_kv(meta)  # already done by handle_preemptions: no-op
    assert _reported(w) == (set(), {"r"}, set())
    assert kv[1][7].tolist() == [3] * 8  # the state object, in the block vLLM assigned
    assert kv[0][1].tolist() == [1] * 16 and kv[0][4].tolist() == [2] * 16
    assert kv[1][0].tolist() == [0xEE] * 8  # the null block is never written
    assert w.stats["loaded_chunks"] == 2 and w.stats["load_failures"] == 0
    assert w.get_block_ids_with_load_errors() == set()
    assert w.transfer_results(set()) == (set(), set(), set())  # reported once


def test_without_overlap_an_asynchronous_load_is_reported_in_the_step_that_starts_it() -> None:
    w, kv = _recurrent_worker([32, 32, 8], overlap=False)  # the default
    w.handle_preemptions(_two_chunk_hit())
    assert w.transfer_results(set()) == (set(), {"r"}, set())
    assert kv[1][7].tolist() == [3] * 8


def test_a_failed_chunk_fails_the_whole_asynchronous_load_without_block_ids() -> None:
    """A state object of the wrong size fails chunk 1: the request is reported finished and failed
    (vLLM frees its blocks and computes it from scratch); no block ids, which vLLM cannot map back
    to requests with several KV-cache groups."""
    w, _ = _recurrent_worker([32, 32, 4])
    w.handle_preemptions(_two_chunk_hit())
    assert _reported(w) == (set(), {"r"}, {"r"})
    assert w.get_block_ids_with_load_errors() == set()
    assert w.stats["loaded_chunks"] == 1 and w.stats["load_failures"] == 1


def test_every_worker_reports_each_asynchronous_load_even_with_nothing_to_copy() -> None:
    """vLLM counts finished_recving per worker (KVOutputAggregator): a load with no chunk this worker
    could place (``complete`` False), or no server, is still reported, as failed."""
    w, _ = _recurrent_worker([])
    w.handle_preemptions(
        TierCacheMetadata(step=1, loads=[RequestLoad("r", [], asynchronous=True, complete=False)])
    )
    assert _reported(w) == (set(), {"r"}, {"r"})
    w, _ = _recurrent_worker([32, 32, 8])
    w.link = FakeLink(None)  # the server is down
    w.handle_preemptions(_two_chunk_hit())
    assert _reported(w) == (set(), {"r"}, {"r"})


def test_an_asynchronous_load_forgets_the_requests_earlier_stores() -> None:
    """The worker's side of the scheduler's rule: once finished, the request is not reported in
    finished_sending for stores of a run before its preemption."""
    w, _ = _recurrent_worker([32, 32, 8])
    w._with_saves.add("r")
    w.handle_preemptions(_two_chunk_hit())
    assert _reported(w) == (set(), {"r"}, set())
    assert w.transfer_results({"r"}) == (set(), set(), set())


def test_a_synchronous_load_reports_the_blocks_of_its_failed_chunks() -> None:
    """One KV-cache group (dense models): vLLM recomputes from the first invalid block."""
    w, _ = _recurrent_worker([32, 4], dense=True)
    meta = TierCacheMetadata(
        step=1,
        loads=[
            RequestLoad(
                "r",
                [
                    ChunkLoad(b"0" * 16, [[0, 1]], [[1, 2]]),
                    ChunkLoad(b"1" * 16, [[0, 1]], [[3, 4]]),
                ],
            )
        ],
    )
    w.handle_preemptions(meta)
    assert w.get_block_ids_with_load_errors() == {3, 4}
    assert w.transfer_results(set()) == (set(), set(), set())


# -- vLLM >= 0.33 sleep-mode hooks (0.32 never calls them; the tests call them directly) -------------


def _connector(
    monkeypatch: pytest.MonkeyPatch, role: KVConnectorRole, half: WorkerHalf | SchedulerHalf
) -> TierCacheConnector:
    """The connector vLLM builds for ``role`` (a kv_both engine), whose half is ``half``: the test's,
    on a fake link. vLLM's log handlers are left to vLLM (the connector would adopt them)."""
    monkeypatch.setattr(connector, "adopt_log_handlers", lambda ours, theirs: None)
    if role == KVConnectorRole.WORKER:
        monkeypatch.setattr(worker, "WorkerHalf", lambda *args, **kwargs: half)
    else:
        monkeypatch.setattr(scheduler, "SchedulerHalf", lambda *args, **kwargs: half)
    transfer = KVTransferConfig(
        kv_connector="TierCacheConnector", kv_role="kv_both", kv_load_failure_policy="recompute"
    )
    return TierCacheConnector(SimpleNamespace(kv_transfer_config=transfer), role)


def test_sleep_mode_hooks_match_vllm_and_drain_queued_stores(monkeypatch: pytest.MonkeyPatch) -> None:
    """``unregister_kv_caches`` (called before sleep mode releases the KV memory) returns only once
    the loads writing into the KV cache and the stores queued for the save thread are done;
    ``restore_kv_caches`` needs nothing. Where the installed vLLM declares the hooks (0.33+), ours
    take the same arguments."""
    for name in ("unregister_kv_caches", "restore_kv_caches"):
        base = getattr(KVConnectorBase_V1, name, None)
        if base is not None:
            assert list(inspect.signature(base).parameters) == list(
                inspect.signature(getattr(TierCacheConnector, name)).parameters
            )

    w, kv = _recurrent_worker([32, 32, 8])
    w.handle_preemptions(_two_chunk_hit())  # an asynchronous load in flight
    w._pending = {"r": 2}
    done: list[float] = []
    caller = threading.current_thread()
    returned: list[float] = []

    def waits_for_the_stores() -> bool:
        """Whether the caller waits for the queued stores (in ``threading.Condition.wait`` on the
        worker's idle condition) or unregister_kv_caches has returned without waiting."""
        frame = sys._current_frames().get(caller.ident or -1)
        while frame is not None:
            if frame.f_code is threading.Condition.wait.__code__ and frame.f_locals.get("self") is w._idle:
                return True
            frame = frame.f_back
        return bool(returned)

    def save_thread() -> None:  # what WorkerHalf._save_loop does when a batch is stored
        wait_until(waits_for_the_stores, timeout=10, interval=0.001, what="unregister_kv_caches to wait")
        with w._idle:
            del w._pending["r"]
            done.append(time.monotonic())
            w._idle.notify_all()

    c = _connector(monkeypatch, KVConnectorRole.WORKER, w)
    t = threading.Thread(target=save_thread)
    t.start()
    c.unregister_kv_caches()
    returned.append(time.monotonic())
    t.join()
    assert done and done[0] <= returned[0] and w._pending == {}
    assert w.transfer_results(set()) == (set(), {"r"}, set())  # the load is done
    assert kv[1][7].tolist() == [3] * 8
    c.unregister_kv_caches()  # idempotent: nothing queued
    c.restore_kv_caches()
    s = _connector(monkeypatch, KVConnectorRole.SCHEDULER, scheduler_half())
    s.unregister_kv_caches()  # the scheduler's instance holds no KV memory
    s.restore_kv_caches()
