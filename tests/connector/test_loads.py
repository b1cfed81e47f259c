"""Load jobs (tiercache/connector/loads.py): a step's page writes, layer by layer, so the forward
pass may read layer i while later layers are still being written. Needs torch; no vLLM."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch", reason="load jobs write torch tensors")

from tiercache.connector.copy import CpuPageCopy  # noqa: E402
from tiercache.connector.loads import PageWrite, ThreadedLoad, forward_order  # noqa: E402
from tiercache.connector.pages import PageView, page_view  # noqa: E402

LAYERS, BLOCKS, PAGE = 4, 6, 32


def _layers() -> tuple[list[torch.Tensor], list[PageView]]:
    tensors = [torch.zeros(BLOCKS, PAGE, dtype=torch.uint8) for _ in range(LAYERS)]
    return tensors, [
        page_view(f"model.layers.{i}.attn", t, page_bytes=PAGE, kernel_blocks=1)
        for i, t in enumerate(tensors)
    ]


def _plan(pages: list[PageView], chunks: int = 2) -> list[list[PageWrite]]:
    """Chunk c writes block c + 1 of every layer with bytes 10 * layer + c + 1."""
    return [
        [
            PageWrite(c, pv, torch.tensor([c + 1]), torch.full((1, PAGE), 10 * i + c + 1, dtype=torch.uint8))
            for c in range(chunks)
        ]
        for i, pv in enumerate(pages)
    ]


class GatedWrites:
    """Writes that wait for the test to open each layer's gate, so the test controls progress."""

    def __init__(self) -> None:
        self.gates = {i: threading.Event() for i in range(LAYERS)}

    def __call__(self, w: PageWrite) -> None:
        layer = int(w.pages.layer.split(".")[2])
        assert self.gates[layer].wait(10)
        w.pages.scatter(w.ids, w.rows())


def _returns_within(fn, seconds: float) -> bool:  # type: ignore[no-untyped-def]
    done = threading.Event()
    threading.Thread(target=lambda: (fn(), done.set()), daemon=True).start()
    return done.wait(seconds)


def test_waiting_for_a_layer_returns_once_that_layer_and_every_earlier_one_is_written() -> None:
    tensors, pages = _layers()
    writes = GatedWrites()
    job = ThreadedLoad(_plan(pages), writes)
    assert not _returns_within(lambda: job.wait_layer(0), 0.05)  # layer 0 not written yet
    writes.gates[0].set()
    job.wait_layer(0)
    assert tensors[0][1].tolist() == [1] * PAGE and tensors[0][2].tolist() == [2] * PAGE
    assert not tensors[1].any()  # layer 1 still gated: the forward pass may run layer 0 meanwhile
    assert not job.done()
    writes.gates[2].set()  # out of order: layer 2 is written only after layer 1
    assert not _returns_within(lambda: job.wait_layer(2), 0.05)
    writes.gates[1].set()
    writes.gates[3].set()
    job.wait_layer(2)
    assert tensors[2][1].tolist() == [21] * PAGE
    assert job.finish() == set() and job.done()
    assert tensors[3][2].tolist() == [32] * PAGE


def test_a_layer_past_the_plan_waits_for_every_write() -> None:
    tensors, pages = _layers()
    job = ThreadedLoad(_plan(pages), lambda w: w.pages.scatter(w.ids, w.rows()))
    job.wait_layer(10**6)  # a layer the worker does not know
    assert all(t[1].any() and t[2].any() for t in tensors)
    job.finish()


def test_a_failed_write_fails_its_chunk_only_and_skips_that_chunks_later_writes() -> None:
    tensors, pages = _layers()
    seen: list[tuple[str, int]] = []

    def write(w: PageWrite) -> None:
        seen.append((w.pages.layer, w.chunk))
        if w.chunk == 1 and w.pages.layer == "model.layers.1.attn":
            raise RuntimeError("device error")
        w.pages.scatter(w.ids, w.rows())

    assert ThreadedLoad(_plan(pages), write).finish() == {1}
    assert [c for _, c in seen].count(1) == 2  # layers 0 and 1; layers 2 and 3 skipped for chunk 1
    assert all(t[1].any() for t in tensors)  # chunk 0 landed in every layer


@pytest.mark.parametrize("overlap", [False, True])
def test_the_cpu_engine_writes_the_same_bytes_with_or_without_overlap(overlap: bool) -> None:
    tensors, pages = _layers()
    job = CpuPageCopy().start_load(_plan(pages), overlap)
    assert job.finish() == set()
    for i, t in enumerate(tensors):
        assert t[1].tolist() == [10 * i + 1] * PAGE and t[2].tolist() == [10 * i + 2] * PAGE
        assert not t[0].any() and not t[3:].any()


def test_partial_rows_pick_their_positions() -> None:
    tensors, pages = _layers()
    src = torch.stack([torch.full((PAGE,), v, dtype=torch.uint8) for v in (7, 8, 9)])
    write = PageWrite(0, pages[0], torch.tensor([4, 2]), src, pos=torch.tensor([2, 0]))
    CpuPageCopy().start_load([[write]], overlap=True).finish()
    assert tensors[0][4].tolist() == [9] * PAGE and tensors[0][2].tolist() == [7] * PAGE


def test_the_forward_pass_starts_before_the_last_layer_is_written() -> None:
    """What overlap buys: with a slow copy, layer 0 is readable long before the whole load is."""
    tensors, pages = _layers()

    def slow(w: PageWrite) -> None:
        time.sleep(0.02)
        w.pages.scatter(w.ids, w.rows())

    job = ThreadedLoad(_plan(pages), slow)
    job.wait_layer(0)
    assert not tensors[LAYERS - 1].any()
    job.finish()
    assert tensors[LAYERS - 1].any()


def test_forward_order_sorts_layers_by_their_index() -> None:
    names = ["model.layers.10.attn", "model.layers.2.attn", "model.layers.2.mamba", "lm_head"]
    assert forward_order(names) == [
        "lm_head",
        "model.layers.2.attn",
        "model.layers.2.mamba",
        "model.layers.10.attn",
    ]
