"""The worker half's store and load paths over kernel-split page views, against a fake server
client whose arena is a real shared mapping. Needs torch and vLLM (the connector metadata derives
from vLLM's); skipped elsewhere."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the worker half needs torch")
pytest.importorskip("vllm", reason="the worker half's metadata types come from vLLM")

from tests.connector.fakes import link_to  # noqa: E402
from tiercache.config.connector import ConnectorSettings  # noqa: E402
from tiercache.connector import worker_saves  # noqa: E402
from tiercache.connector.copy import CpuPageCopy  # noqa: E402
from tiercache.connector.layout import GroupLayout, verify_kv_caches  # noqa: E402
from tiercache.connector.metadata import (  # noqa: E402
    ChunkLoad,
    ChunkSave,
    RequestLoad,
    TierCacheMetadata,
)
from tiercache.connector.worker import WorkerHalf  # noqa: E402
from tiercache.errors import ServerUnavailableError  # noqa: E402
from tiercache.keys import GroupKind, LayoutManifest  # noqa: E402
from tiercache.l1.arena import SharedArena  # noqa: E402
from tiercache.testing.poll import wait_blocked  # noqa: E402
from tiercache.wire import protocol as p  # noqa: E402

K, KERNEL_BLOCK, HEADS, HEAD, NUM_BLOCKS, BPC = 4, 4, 2, 8, 9, 2
PAGE = K * KERNEL_BLOCK * HEADS * 2 * HEAD * 2  # bf16, K|V per head


class FakeClient:
    """reserve → copy → commit and pin → copy → release, over a real arena: a
    :class:`~tiercache.client.transfer.DataPathClient` with a clock the test moves."""

    def __init__(self, arena: SharedArena) -> None:
        self._arena, self._next, self.objects, self.pending = arena, 0, {}, {}
        self.expired: set[int] = set()  # lease tokens the "server" let expire before their release
        self.pins = 0  # pin calls
        self.now = 1000.0  # the clock holds are timed by: a test moves it instead of sleeping
        self.lease_window_s = 100.0
        self.reservation_window_s = 100.0
        self.corrupt: list[p.Slot] = []  # slots reported corrupt

    def clock(self) -> float:
        return self.now

    def arena(self) -> SharedArena:
        return self._arena

    def in_session(self, call: Any) -> tuple[Any, SharedArena]:
        return call(), self._arena  # one arena: the "server" never restarts

    def reserve(
        self,
        items: list[tuple[Any, int]],
        timeout: float | None = None,
        *,
        tenants: Any = (),
        holds: Any = (),
    ) -> list[p.Slot]:
        self.holds = list(holds)  # the last reservation's (prefix hash, blocks) for the block index
        slots = []
        for key, nbytes in items:
            slot = p.Slot(key.to_bytes(), self._next, nbytes, len(self.pending) + len(self.objects) + 1)
            self._next += nbytes
            self.pending[slot.token] = (key, slot)
            slots.append(slot)
        return slots

    def commit(
        self, tokens: list[int], digests: list[int], timeout: float | None = None, supersedes: Any = ()
    ) -> int:
        for t, d in zip(tokens, digests, strict=True):
            key, slot = self.pending.pop(t)
            self.objects[key] = p.Slot(slot.key, slot.offset, slot.nbytes, slot.token, d)
        for key in supersedes:  # as the server does: once the covering chunk is visible
            self.objects.pop(key, None)
        return len(tokens)

    def abort(self, tokens: list[int], timeout: float | None = None) -> int:
        for t in tokens:
            self.pending.pop(t, None)
        return len(tokens)

    def pin(self, keys: list[Any], timeout: float | None = None) -> list[p.Slot | None]:
        self.pins += 1
        return [self.objects.get(k) for k in keys]

    def release_leases(self, tokens: list[int], timeout: float | None = None) -> set[int]:
        return self.expired.intersection(tokens)

    def release_leases_later(self, tokens: list[int]) -> None:
        pass

    def report_corrupt(self, slots: list[p.Slot]) -> None:
        self.corrupt += slots


def _kv() -> torch.Tensor:
    """A FlashAttention-style vLLM 0.32 cache split into kernel blocks: ``[B*k, H, N, K|V]``."""
    return torch.zeros(NUM_BLOCKS * K, HEADS, KERNEL_BLOCK, 2 * HEAD, dtype=torch.bfloat16)


#: Builds a started worker half whose server is the client given: ``(worker, its KV caches)``.
MakeWorker = Callable[..., tuple[WorkerHalf, dict[str, torch.Tensor]]]


@pytest.fixture
def arena() -> Iterator[SharedArena]:
    arena = SharedArena.create(None, 1 << 20)
    try:
        yield arena
    finally:
        arena.close()
        arena.unlink()


@pytest.fixture
def make_worker(arena: SharedArena) -> Iterator[MakeWorker]:
    """Worker halves started as vLLM starts one (``register_kv_caches``: the save thread runs) and
    connected to a :class:`FakeClient` over ``arena``; each is shut down after the test, before
    the arena is unmapped."""
    started: list[WorkerHalf] = []

    def make(
        client: FakeClient,
        *,
        settings: ConnectorSettings | None = None,
        copy: CpuPageCopy | None = None,
        producer: bool = False,
    ) -> tuple[WorkerHalf, dict[str, torch.Tensor]]:
        group = _group()
        caches = {"l0": _kv(), "l1": _kv()}
        w = WorkerHalf(
            None, None, settings or ConnectorSettings(), link=link_to(client), reserve_before_return=producer
        )
        started.append(w)
        w.register_kv_caches(caches)
        # What connecting does: the layout checked against the tensors, copies through ``copy``.
        w.use_layout(
            [group], verify_kv_caches([group], caches, None), {0: group.fingerprint}, copy or CpuPageCopy()
        )
        return w, caches

    try:
        yield make
    finally:
        for w in started:
            w.shutdown()


@pytest.fixture
def worker(
    arena: SharedArena, make_worker: MakeWorker
) -> tuple[WorkerHalf, FakeClient, dict[str, torch.Tensor]]:
    client = FakeClient(arena)
    w, caches = make_worker(client)
    return w, client, caches


def _store(w: WorkerHalf, *saves: ChunkSave) -> None:
    """One step's stores: queued after its forward pass (``wait_for_save``), then finished
    (``quiesce``), so the test reads what the save thread stored."""
    w.wait_for_save(TierCacheMetadata(saves=list(saves)))
    w.quiesce()


def _group() -> GroupLayout:
    manifest = LayoutManifest(
        model_id="m",
        model_revision="r",
        kv_dtype="bfloat16",
        attention_backend="FLASH_ATTN",
        kv_layout="LBHNC",
        kernel_block_size=KERNEL_BLOCK,
        manager_block_size=K * KERNEL_BLOCK,
        page_bytes=PAGE,
        page_bytes_unpadded=PAGE,
        group_kind=GroupKind.FULL_ATTENTION,
        chunk_size=BPC * K * KERNEL_BLOCK,
        num_layers=2,
    )
    return GroupLayout(0, 0, 0, ("l0", "l1"), K * KERNEL_BLOCK, BPC, PAGE, manifest)


def _manager_block(t: torch.Tensor, b: int) -> torch.Tensor:
    return t[b * K : (b + 1) * K]


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlapped"])
def test_a_stored_chunk_loads_into_other_blocks_byte_for_byte(
    arena: SharedArena, make_worker: MakeWorker, overlap: bool
) -> None:
    client = FakeClient(arena)
    w, caches = make_worker(client, settings=ConnectorSettings(overlap_loads=overlap))
    g = torch.Generator().manual_seed(7)
    for t in caches.values():
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    before = {n: t.clone() for n, t in caches.items()}
    _store(w, ChunkSave("r", 0, b"p" * 16, [[5, 2]]))
    assert w.stats["saved_chunks"] == 1 and len(client.objects) == 1

    for t in caches.values():
        t.zero_()
    meta = TierCacheMetadata(loads=[RequestLoad("r2", [ChunkLoad(b"p" * 16, [[0, 1]], [[7, 3]])])])
    w.start_load_kv(meta)
    for name in caches:  # what each attention layer does before reading its KV
        w.wait_for_layer_load(name)
        assert torch.equal(_manager_block(caches[name], 7), _manager_block(before[name], 5))
    assert not w.get_block_ids_with_load_errors()  # the end of the step: the load is reported
    assert w.stats["loaded_chunks"] == 1
    for n, t in caches.items():
        assert torch.equal(_manager_block(t, 7), _manager_block(before[n], 5))
        assert torch.equal(_manager_block(t, 3), _manager_block(before[n], 2))
        untouched = [b for b in range(NUM_BLOCKS) if b not in (7, 3)]
        assert all(not _manager_block(t, b).any() for b in untouched)  # block 0 included


def test_a_partial_load_writes_only_the_missing_positions(worker) -> None:  # type: ignore[no-untyped-def]
    w, _client, caches = worker
    for i, t in enumerate(caches.values()):
        t.fill_(float(i + 1))
    _store(w, ChunkSave("r", 0, b"q" * 16, [[1, 2]]))
    for t in caches.values():
        t.zero_()
    w.start_load_kv(TierCacheMetadata(loads=[RequestLoad("r", [ChunkLoad(b"q" * 16, [[1]], [[4]])])]))
    assert not w.get_block_ids_with_load_errors()
    for i, t in enumerate(caches.values()):
        assert (_manager_block(t, 4) == float(i + 1)).all()
        assert t.count_nonzero() == _manager_block(t, 4).numel()


def test_a_tail_block_is_an_object_of_one_page_per_layer_and_loads_into_any_block(worker) -> None:  # type: ignore[no-untyped-def]
    w, client, caches = worker
    g = torch.Generator().manual_seed(3)
    for t in caches.values():
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    before = {n: t.clone() for n, t in caches.items()}
    _store(w, ChunkSave("r", 0, b"t" * 16, [[6]], blocks=1))
    [slot] = client.objects.values()
    assert slot.nbytes == 2 * PAGE  # two layers, one block: half a chunk's object
    for t in caches.values():
        t.zero_()
    w.start_load_kv(
        TierCacheMetadata(loads=[RequestLoad("r2", [ChunkLoad(b"t" * 16, [[0]], [[2]], blocks=1)])])
    )
    assert not w.get_block_ids_with_load_errors()
    for n, t in caches.items():
        assert torch.equal(_manager_block(t, 2), _manager_block(before[n], 6))
        assert t.count_nonzero() == _manager_block(t, 2).count_nonzero()


def test_a_tail_object_is_never_loaded_as_a_whole_chunk_nor_a_chunk_as_a_tail(worker) -> None:  # type: ignore[no-untyped-def]
    """The sizes differ, so a key mix-up is a failed load (recomputed), never misplaced bytes."""
    w, _client, _caches = worker
    _store(w, ChunkSave("r", 0, b"a" * 16, [[6]], blocks=1), ChunkSave("r", 0, b"b" * 16, [[1, 2]]))
    loads = [ChunkLoad(b"a" * 16, [[0, 1]], [[3, 4]]), ChunkLoad(b"b" * 16, [[0]], [[5]], blocks=1)]
    w.start_load_kv(TierCacheMetadata(loads=[RequestLoad("r2", loads)]))
    assert w.get_block_ids_with_load_errors() == {3, 4, 5}


def test_storing_a_full_chunk_drops_the_tails_it_covers(worker) -> None:  # type: ignore[no-untyped-def]
    w, client, _ = worker
    _store(w, ChunkSave("r", 0, b"t" * 16, [[6]], blocks=1))
    assert len(client.objects) == 1
    _store(w, ChunkSave("r", 0, b"c" * 16, [[6, 7]], supersedes=[b"t" * 16]))
    assert [k.prefix_hash for k in client.objects] == [b"c" * 16]


def test_a_chunk_holding_the_null_block_stores_nothing(worker) -> None:  # type: ignore[no-untyped-def]
    w, client, _ = worker
    _store(w, ChunkSave("r", 0, b"z" * 16, [[3, 0]]))  # never read block 0 (vLLM's null block)
    assert not client.objects


def test_a_store_that_ends_late_is_logged_once_a_minute_with_how_many_were_late(
    worker: tuple[WorkerHalf, FakeClient, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store that ends ``SLOW_STORE_S`` or more after its step queued it says so (a lookup waiting
    for it as a store in flight may have given up); the next ones within a minute are counted and
    the next line that goes out says how many."""
    w, client, _ = worker
    monkeypatch.setattr(worker_saves, "SLOW_STORE_S", 0.0)  # every store is "late"
    with caplog.at_level(logging.WARNING, logger=worker_saves.__name__):
        _store(w, ChunkSave("r", 0, b"a" * 16, [[1, 2]]))
        _store(w, ChunkSave("r", 0, b"b" * 16, [[3, 4]]))
    assert len(client.objects) == 2  # logged, still stored
    [line] = [r.getMessage() for r in caplog.records if "after its step" in r.getMessage()]
    assert "a store of 1 chunk(s) ended" in line and "1 slow store(s) since the last such line" in line
    assert "inflight_wait_s" in line
    w._slow_logged_at -= 60.0  # a minute later
    with caplog.at_level(logging.WARNING, logger=worker_saves.__name__):
        _store(w, ChunkSave("r", 0, b"c" * 16, [[5, 6]]))
    lines = [r.getMessage() for r in caplog.records if "after its step" in r.getMessage()]
    assert len(lines) == 2 and "2 slow store(s) since the last such line" in lines[1]


class RecordingCopy(CpuPageCopy):
    """The CPU engine, noting which thread asked for a save point and what each save waited for."""

    def __init__(self) -> None:
        self.points: list[tuple[str, object]] = []
        self.waited: list[tuple[str, object]] = []

    def save_point(self) -> object:
        token = object()
        self.points.append((threading.current_thread().name, token))
        return token

    def save(self, ready, pages, ids, dsts, digest, zeros=0) -> None:  # type: ignore[no-untyped-def]
        self.waited.append((threading.current_thread().name, ready))
        super().save(ready, pages, ids, dsts, digest, zeros)


def test_saves_wait_for_the_save_point_taken_after_the_forward_pass(
    arena: SharedArena, make_worker: MakeWorker
) -> None:
    """The model-runner thread takes the save point (CUDA: an event on the compute stream) when it
    queues the step's saves; the store thread's copies wait for exactly that point."""
    client, copy = FakeClient(arena), RecordingCopy()
    w, _ = make_worker(client, copy=copy)
    w.wait_for_save(TierCacheMetadata(saves=[ChunkSave("r", 0, b"s" * 16, [[1, 2]])]))
    assert w.get_finished({"r"}) == ({"r"}, None)  # waits for the request's saves
    [(point_thread, token)] = copy.points
    assert point_thread == threading.current_thread().name
    assert copy.waited == [("tiercache-connector-save", token)]
    assert len(client.objects) == 1


# -- kernel block size from the config (both halves must derive the same manifest) ----------------


class _SixteenTokenBackend:
    """A backend that, like FlashAttention variants with fixed sizes, runs 16-token blocks only."""

    @staticmethod
    def get_name() -> str:
        return "SIXTEEN"

    @classmethod
    def get_supported_kernel_block_sizes(cls, spec: object = None) -> list[int]:
        return [16]


@pytest.fixture
def sixteen_token_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib

    import vllm.config
    import vllm.v1.attention.selector

    monkeypatch.setattr(vllm.v1.attention.selector, "get_attn_backend", lambda *a, **k: _SixteenTokenBackend)
    monkeypatch.setattr(vllm.config, "set_current_vllm_config", lambda cfg: contextlib.nullcontext())


def _derive(block_stride: int = 100, padded: int | None = None) -> int:
    from types import SimpleNamespace as NS

    from tiercache.connector.kernel_blocks import derive_kernel_block_size

    cfg = NS(model_config=NS(dtype="bfloat16"), cache_config=NS(cache_dtype="auto"))
    spec = NS(block_size=64, head_size=64, sliding_window=None, has_layer_views=True, page_size_padded=padded)
    kv_cache_config = NS(kv_cache_tensors=[NS(layers=["a"], block_stride=block_stride, layer_stride=1000)])
    return derive_kernel_block_size(cfg, kv_cache_config, ["a"], spec)


def test_a_backend_with_smaller_blocks_splits_the_manager_block(sixteen_token_backend: None) -> None:
    assert _derive() == 16


def test_block_outermost_packing_and_padded_pages_are_never_split(sixteen_token_backend: None) -> None:
    assert _derive(block_stride=5000) == 64  # other layers' pages between blocks (vLLM: no split)
    assert _derive(padded=1 << 20) == 64


def test_an_underivable_kernel_block_falls_back_to_the_manager_block(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.v1.attention.selector

    def broken(*a: object, **k: object) -> object:
        raise RuntimeError("no backend here")

    monkeypatch.setattr(vllm.v1.attention.selector, "get_attn_backend", broken)
    assert _derive() == 64  # the worker then checks the real tensors and refuses a mismatch


# -- a producer (prefill engine) reserves its step's stores before the step returns ----------------


class GatedClient(FakeClient):
    """A server whose reserve answers only once ``gate`` is opened, within ``timeout`` seconds (as
    the real client's bound: ServerUnavailableError after it); notes when it answered."""

    def __init__(self, arena: SharedArena, timeout: float = 10.0) -> None:
        super().__init__(arena)
        self.gate, self.reserved, self.timeout = threading.Event(), threading.Event(), timeout

    def reserve(
        self,
        items: list[tuple[Any, int]],
        timeout: float | None = None,
        *,
        tenants: Any = (),
        holds: Any = (),
    ) -> list[p.Slot]:
        from tiercache.errors import ServerUnavailableError

        if not self.gate.wait(self.timeout):
            raise ServerUnavailableError("no reply in time")
        slots = super().reserve(items)
        self.reserved.set()
        return slots


@pytest.mark.parametrize("producer", [True, False], ids=["kv_producer", "kv_both"])
def test_a_producers_step_returns_only_once_its_stores_are_reserved(
    arena: SharedArena, make_worker: MakeWorker, producer: bool
) -> None:
    """So its response can never reach the decode engine before the server knows the chunks are
    coming (a decode lookup then waits for their commit); kv_both does not wait."""
    gated = GatedClient(arena)
    w, _ = make_worker(gated, producer=producer)
    meta = TierCacheMetadata(saves=[ChunkSave("r", 0, b"g" * 16, [[1, 2]])])
    step = threading.Thread(target=w.wait_for_save, args=(meta,), name="model-runner")
    step.start()
    if producer:  # the step is seen waiting for the server's answer, and only then gets it
        wait_blocked(step, GatedClient.reserve, what="the producer's step to wait for its reserve")
        gated.gate.set()
    step.join(gated.timeout / 2)  # a kv_both step that waited for the reserve would still wait
    assert not step.is_alive()  # kv_both: returned with the reserve still unanswered
    assert gated.reserved.is_set() is producer
    gated.gate.set()
    assert w.get_finished({"r"}) == ({"r"}, None)
    assert len(gated.objects) == 1


def test_a_producer_whose_server_never_answers_skips_the_store_at_the_clients_timeout(
    arena: SharedArena, make_worker: MakeWorker
) -> None:
    gated = GatedClient(arena, timeout=0.1)
    w, _ = make_worker(gated, producer=True)
    w.wait_for_save(TierCacheMetadata(saves=[ChunkSave("r", 0, b"h" * 16, [[1, 2]])]))
    assert w.link.failures == ["store"]  # the link goes down: later steps skip at once
    assert w.get_finished({"r"}) == ({"r"}, None)
    assert not gated.objects and w.stats["save_skipped"] == 1


def test_a_synchronous_loads_time_ends_when_its_writes_are_done_not_at_the_steps_end(worker) -> None:  # type: ignore[no-untyped-def]
    """vLLM reports a synchronous load at the end of its step, after the forward pass; the
    connector's load time (``vllm:tiercache_load_seconds``) must not include that pass."""

    w, _client, _ = worker
    _store(w, ChunkSave("r", 0, b"t" * 16, [[1, 2]]))
    w.take_stats()
    before = time.perf_counter()
    w.start_load_kv(TierCacheMetadata(loads=[RequestLoad("r", [ChunkLoad(b"t" * 16, [[0, 1]], [[4, 5]])])]))
    written = time.perf_counter() - before  # the CPU engine writes inline: the load is done here
    w.wait_for_layer_load("l1")  # ... the forward pass runs ...
    assert not w.get_block_ids_with_load_errors()  # the end of the step: the load is reported
    stats = w.take_stats()
    assert stats is not None
    assert 0 < stats.data["load_seconds"] <= written


def _assert_failed_load(w: Any, asynchronous: bool) -> None:
    """vLLM hears that request "r2"'s load into blocks 7 and 3 failed: an asynchronous load is
    reported done and failed, a synchronous one's blocks are load errors."""
    if asynchronous:
        w.quiesce()  # the load job finishes; the request is reported with the step's results
        _, done, failed = w.transfer_results(set())
        assert done == {"r2"} and failed == {"r2"}
    else:
        assert w.get_block_ids_with_load_errors() == {7, 3}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_chunk_copied_under_a_lease_that_expired_is_a_failed_load(worker, asynchronous: bool) -> None:  # type: ignore[no-untyped-def]
    """The bytes were copied, but the server says the lease expired before the release: its slot
    may have held another chunk's bytes by then, so vLLM is told to recompute (sync: the chunk's
    blocks are load errors; async: the request failed), never that the chunk loaded."""
    w, client, _ = worker
    _store(w, ChunkSave("r", 0, b"p" * 16, [[5, 2]]))
    [stored] = client.objects.values()
    client.expired.add(stored.token)
    load = RequestLoad("r2", [ChunkLoad(b"p" * 16, [[0, 1]], [[7, 3]])], asynchronous=asynchronous)
    w.start_load_kv(TierCacheMetadata(loads=[load]))
    client.now += client.lease_window_s  # the copy outlasted what time vouches for: the server is asked
    _assert_failed_load(w, asynchronous)
    assert w.stats["loaded_chunks"] == 0
    assert w.stats["load_failures"] == 1
    assert w.stats["lost_leases"] == 1


def test_a_release_the_server_cannot_confirm_is_a_failed_load(worker) -> None:  # type: ignore[no-untyped-def]
    """A release that fails (server gone, session dropped) confirms no lease: recompute."""
    w, client, _ = worker
    _store(w, ChunkSave("r", 0, b"p" * 16, [[5, 2]]))

    def unreachable(tokens: list[int]) -> set[int]:
        raise ServerUnavailableError("gone")

    client.release_leases = unreachable  # type: ignore[method-assign]
    w.start_load_kv(TierCacheMetadata(loads=[RequestLoad("r2", [ChunkLoad(b"p" * 16, [[0, 1]], [[7, 3]])])]))
    client.now += client.lease_window_s  # the copy outlasted what time vouches for: the server is asked
    assert w.get_block_ids_with_load_errors() == {7, 3}
    assert w.stats["loaded_chunks"] == 0 and w.stats["lost_leases"] == 1


def _ticket_load(client: FakeClient, arena: str | None = None, **kw: Any) -> RequestLoad:
    """A load of the chunk ``_store`` stored, naming the slot it is in (as the scheduler's
    lookup ticket pinned it), sent just now."""
    [stored] = client.objects.values()
    return RequestLoad(
        "r2",
        [ChunkLoad(b"p" * 16, [[0, 1]], [[7, 3]], slots=[(0, stored.offset, stored.nbytes, stored.digest)])],
        leased_at=client.now,
        arena=client.arena().name if arena is None else arena,
        **kw,
    )


def test_a_load_from_the_tickets_slots_copies_them_without_a_pin(worker) -> None:  # type: ignore[no-untyped-def]
    w, client, caches = worker
    _store(w, ChunkSave("r", 0, b"p" * 16, [[5, 2]]))
    w.start_load_kv(TierCacheMetadata(step=1, loads=[_ticket_load(client)]))
    assert client.pins == 0
    assert not w.get_block_ids_with_load_errors() and w.stats["loaded_chunks"] == 1
    for t in caches.values():
        assert torch.equal(_manager_block(t, 7), _manager_block(t, 5))
        assert torch.equal(_manager_block(t, 3), _manager_block(t, 2))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_copy_from_the_tickets_slots_that_ended_too_late_for_its_leases_is_a_failed_load(  # type: ignore[no-untyped-def]
    worker, asynchronous: bool
) -> None:
    """Time alone no longer vouches for the ticket's leases: the slot may hold another chunk's
    bytes by then, so vLLM is told to recompute, never that the chunk loaded."""
    w, client, _ = worker
    _store(w, ChunkSave("r", 0, b"p" * 16, [[5, 2]]))
    w.start_load_kv(TierCacheMetadata(step=1, loads=[_ticket_load(client, asynchronous=asynchronous)]))
    client.now += client.lease_window_s / 2  # the copy "ended" half the leases' window after the lookup
    _assert_failed_load(w, asynchronous)
    assert w.stats["loaded_chunks"] == 0 and w.stats["lost_leases"] == 1


def test_slots_in_another_servers_arena_are_never_read_the_worker_pins_by_key(worker) -> None:  # type: ignore[no-untyped-def]
    """A server restarted since the lookup has another arena: the offsets mean nothing in it."""
    w, client, caches = worker
    _store(w, ChunkSave("r", 0, b"p" * 16, [[5, 2]]))
    w.start_load_kv(TierCacheMetadata(step=1, loads=[_ticket_load(client, arena="tiercache-gone")]))
    assert not w.get_block_ids_with_load_errors()
    assert client.pins == 1 and w.stats["loaded_chunks"] == 1
    for t in caches.values():
        assert torch.equal(_manager_block(t, 7), _manager_block(t, 5))


def test_a_load_planned_too_long_after_its_lookup_pins_by_key_instead(worker) -> None:  # type: ignore[no-untyped-def]
    """A quarter of what the leases vouch for has passed since the lookup (the request waited for
    blocks): the copy might outlive them, so the worker pins the objects itself and loads."""
    w, client, caches = worker
    _store(w, ChunkSave("r", 0, b"p" * 16, [[5, 2]]))
    load = _ticket_load(client)
    client.now += client.lease_window_s / 4  # the request waited for blocks since its lookup
    w.start_load_kv(TierCacheMetadata(step=1, loads=[load]))
    assert client.pins == 1 and not w.get_block_ids_with_load_errors() and w.stats["loaded_chunks"] == 1
    for t in caches.values():
        assert torch.equal(_manager_block(t, 7), _manager_block(t, 5))
