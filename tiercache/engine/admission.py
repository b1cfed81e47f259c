"""L3 admission: which chunks the engine writes to S3 (``--l3-admission``, docs/s3.md#admission).

``all`` writes every chunk the write policy hands over. ``read`` writes a chunk only once it has
been read (a prefetch, a load, a pin) at least once since it was stored:

* with write-through, at its first read once it is on the disk (or when it reaches the disk, if it
  was read before); a chunk never read is never written, and is counted *refused* when the rule
  forgets it (it drops out of the window unread);
* with write-back, when the disk evicts it: admitted if it was read, refused (``unread``) if not,
  or refused (``untracked``) if the rule has no mark of it (stored before this engine started, or
  its mark fell out of the window). A refused eviction is a decision, not a loss: it is counted
  here, never as ``writeback_lost_*``.

The marks are bounded: at most ``l3_admission_window`` chunks (oldest forgotten first), in one
ordered dictionary per engine under one lock; nothing is kept at module level.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from tiercache.config.parts import EngineConfig, L3Admission, L3WritePolicy
from tiercache.engine.counters import EngineCounters
from tiercache.keys.object_key import ObjectKey

#: Why the rule refused a chunk: it was never read since stored, or the rule lost track of it.
RefusalReason = Literal["unread", "untracked"]
REFUSAL_REASONS: tuple[RefusalReason, ...] = ("unread", "untracked")


@dataclass(slots=True)
class _Mark:
    """What the rule knows of one stored chunk."""

    read: bool = False  # read at least once since it was stored
    on_disk: bool = False  # write-through: its disk write completed (S3 copies from the disk)


class AdmissionRule:
    """Decides which chunks are handed to S3, and counts each decision (``l3_admitted``,
    ``l3_refused_<reason>``). Thread-safe; every method is non-blocking (one short lock).

    With ``all`` it keeps no marks and admits everything it is asked about.
    """

    def __init__(self, config: EngineConfig, counters: EngineCounters) -> None:
        self._counters = counters
        self._reads = config.l3_admission is L3Admission.READ
        self._through = config.l3_write_policy is L3WritePolicy.THROUGH
        self._window = config.l3_admission_window
        self._lock = threading.Lock()
        self._marks: OrderedDict[ObjectKey, _Mark] = OrderedDict()  # oldest first; guarded by _lock

    @property
    def watches_reads(self) -> bool:
        """Whether reads change anything (``read``): callers skip collecting keys otherwise."""
        return self._reads

    def waiting(self) -> int:
        """Chunks remembered and not yet decided (``l3_admission_waiting``)."""
        with self._lock:
            return len(self._marks)

    def stored(self, key: ObjectKey) -> None:
        """``key`` was committed to L1 and is on its way to the disk: remember it, unread (a chunk
        stored again starts over). Beyond the window the oldest marks are forgotten."""
        if not self._reads:
            return
        forgotten: list[_Mark] = []
        with self._lock:
            self._marks.pop(key, None)
            self._marks[key] = _Mark()
            while len(self._marks) > self._window:
                forgotten.append(self._marks.popitem(last=False)[1])
        if self._through:
            # Nothing will admit these any more: refused now. With write-back they are still on the
            # disk, and are counted (untracked) when it evicts them.
            for mark in forgotten:
                self._refuse("untracked" if mark.read else "unread")

    def forget(self, key: ObjectKey) -> None:
        """``key`` will never reach the disk (its disk write was dropped or failed; counted there):
        drop its mark without a decision, since neither rule would write it to S3."""
        if self._reads:
            with self._lock:
                self._marks.pop(key, None)

    def on_disk(self, key: ObjectKey) -> bool:
        """Write-through: ``key``'s disk write completed. ``True`` (admitted, counted) when it goes
        to S3 now; otherwise it waits for its first read."""
        if not self._reads:
            self._counters.add("l3_admitted")
            return True
        with self._lock:
            mark = self._marks.get(key)
            if mark is None:  # forgotten while its disk write was queued: refused then
                return False
            if not mark.read:
                mark.on_disk = True
                return False
            del self._marks[key]
        self._counters.add("l3_admitted")
        return True

    def read(self, keys: Iterable[ObjectKey]) -> list[ObjectKey]:
        """``keys`` were read. Returns those admitted by it (write-through: first read, already on
        disk), to be queued for S3 now; with write-back the marks are only updated."""
        if not self._reads:
            return []
        admitted: list[ObjectKey] = []
        with self._lock:
            for key in keys:
                mark = self._marks.get(key)
                if mark is None:  # not stored here, or already decided
                    continue
                if self._through and mark.on_disk:  # (a read one on disk was admitted already)
                    del self._marks[key]
                    admitted.append(key)
                else:
                    mark.read = True
                    self._marks.move_to_end(key)  # a read chunk is the last to be forgotten
        if admitted:
            self._counters.add("l3_admitted", len(admitted))
        return admitted

    def evicted(self, key: ObjectKey) -> bool:
        """Write-back: the disk is evicting ``key``. ``True`` (admitted, counted) when it goes to
        S3; otherwise it is refused, counted by reason."""
        if not self._reads:
            self._counters.add("l3_admitted")
            return True
        with self._lock:
            mark = self._marks.pop(key, None)
        if mark is not None and mark.read:
            self._counters.add("l3_admitted")
            return True
        self._refuse("unread" if mark is not None else "untracked")
        return False

    def _refuse(self, reason: RefusalReason) -> None:
        self._counters.add(f"l3_refused_{reason}")
