"""Load jobs: one step's page writes from the L1 arena into the KV cache, layer by layer.

The worker plans a step's loads as a list indexed by *layer position* (the order the forward pass
runs the layers in), each entry the :class:`PageWrite` of that layer. A copy engine turns the plan
into a :class:`LoadJob`:

* :class:`FinishedLoad` — every write done before it is returned (no overlap);
* :class:`ThreadedLoad` — CPU: a background thread writes layer after layer while the forward pass
  runs; ``wait_layer(i)`` (from vLLM's ``wait_for_layer_load``, at the entry of each attention
  layer) blocks until layers ``0..i`` are written, so the first layers compute while later ones
  are still being copied. ``torch`` copies release the GIL, so the thread really runs alongside.

``finish`` waits for everything and names the chunks whose writes failed; only then may the arena
slots be released. Failures are per chunk: the worker reports a failed chunk to vLLM, which
recomputes it, exactly as for a chunk that could not be pinned.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from tiercache.client.affinity import spread_current_thread
from tiercache.client.transfer import SlotCheck
from tiercache.connector.pages import PageView

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PageWrite:
    """Write ``src`` (rows ``pos`` of it, or all) into the pages of blocks ``ids`` of one layer.

    ``check`` is the check of the copy out of the slot ``src`` lies in, and ``part`` (start,
    bytes) where ``src`` lies in that slot: a copier that knows when its write landed tells the
    check right after (:meth:`~tiercache.client.transfer.SlotCheck.copied`), while it is cached.
    """

    chunk: int  # the chunk's index in the step's load: failures are reported per chunk
    pages: PageView
    ids: torch.Tensor  # block ids, CPU int64
    src: torch.Tensor  # host uint8 [blocks of the chunk, page_bytes]: a view of the arena slot
    pos: torch.Tensor | None = None  # which rows of ``src`` (None: all, in order)
    check: SlotCheck | None = None
    part: tuple[int, int] = (0, 0)

    def rows(self) -> torch.Tensor:
        """The source rows, one per block id."""
        return self.src if self.pos is None else self.src.index_select(0, self.pos)


LoadPlan = Sequence[Sequence[PageWrite]]  # per layer position, that layer's writes


class LoadJob(ABC):
    """A step's writes in flight (see the module docstring)."""

    @abstractmethod
    def wait_layer(self, position: int) -> None:
        """Return once the writes of layer positions ``0..position`` are done (or, on a device,
        ordered before later work on the current stream). A position past the plan waits for all."""

    @abstractmethod
    def done(self) -> bool:
        """Whether :meth:`finish` would return without waiting."""

    @abstractmethod
    def finish(self) -> set[int]:
        """Wait for every write; the chunks with a failed write. Idempotent."""

    #: ``perf_counter()`` when the writes were done, where the host knows it (``None``: not yet, or
    #: only a device knows). What the connector's load time ends at: a synchronous load is
    #: *reported* at the end of its step, after the forward pass, which is no part of the load.
    finished_at: float | None = None


class FinishedLoad(LoadJob):
    """Writes already done when the job is made."""

    def __init__(self, failed: set[int]) -> None:
        self._failed = failed
        self.finished_at = time.perf_counter()

    def wait_layer(self, position: int) -> None:
        return None

    def done(self) -> bool:
        return True

    def finish(self) -> set[int]:
        return self._failed


def run_writes(plan: LoadPlan, write: Callable[[PageWrite], None], failed: set[int]) -> None:
    """Do ``plan``'s writes in layer order, adding the chunk of each write that raises to ``failed``
    (the chunk's later writes are skipped: vLLM recomputes it anyway)."""
    for writes in plan:
        run_layer(writes, write, failed)


def run_layer(writes: Iterable[PageWrite], write: Callable[[PageWrite], None], failed: set[int]) -> None:
    """One layer's writes of :func:`run_writes`."""
    for w in writes:
        if w.chunk in failed:
            continue
        try:
            write(w)
        except Exception as exc:  # a cache failure is a recompute, never a crash
            log.warning("tiercache: writing a loaded chunk into the KV cache failed: %s", exc)
            failed.add(w.chunk)


class ThreadedLoad(LoadJob):
    """Writes done by a background thread, layer by layer (see the module docstring)."""

    def __init__(self, plan: LoadPlan, write: Callable[[PageWrite], None]) -> None:
        self._plan = plan
        self._write = write
        self._failed: set[int] = set()
        self._written = 0  # layer positions [0, _written) are done
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="tiercache-connector-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        spread_current_thread()
        try:
            for i, writes in enumerate(self._plan):
                run_layer(writes, self._write, self._failed)
                with self._cond:
                    self._written = i + 1
                    self._cond.notify_all()
        except BaseException:  # never leave a waiting forward pass hanging
            self._failed.update(w.chunk for writes in self._plan for w in writes)
            raise
        finally:
            with self._cond:
                self._written = len(self._plan)
                self.finished_at = time.perf_counter()
                self._cond.notify_all()

    def wait_layer(self, position: int) -> None:
        need = min(position + 1, len(self._plan))
        with self._cond:
            self._cond.wait_for(lambda: self._written >= need)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def finish(self) -> set[int]:
        self._thread.join()
        return self._failed


_NUMBER = re.compile(r"\d+")


def forward_order(layer_names: Iterable[str]) -> list[str]:
    """Layer names in the order the forward pass runs them: by the first number in the name
    (``model.layers.12.self_attn.attn`` → 12, vLLM's own convention), names without a number
    first, ties in their given order. A wrong guess only costs overlap: :meth:`LoadJob.wait_layer`
    waits for every earlier position too."""
    names = list(dict.fromkeys(layer_names))

    def index(item: tuple[int, str]) -> tuple[int, int]:
        found = _NUMBER.search(item[1])
        return (int(found.group()) if found else -1, item[0])

    return [name for _, name in sorted(enumerate(names), key=index)]
