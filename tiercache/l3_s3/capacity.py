"""The S3 tier's capacity index: every object under the prefix with its size and age, oldest first,
in 48 bytes each: what the capacity bound evicts from, and what ``usage`` reports without a request.

A bucket shared by a fleet holds many millions of chunks, and every node keeps this index of all of
them (the bound is on the prefix as a whole, so each node must know what the others wrote). Python
objects per entry cost ~800 bytes; here the bulk of the index is four numpy columns sorted by key
(the 35-byte key, the age in whole seconds, the size, two flag bits) and the order to evict them in
(an int32 per entry): 48 bytes an object, and a listing of the prefix is merged in whole-array
operations (sort, search) rather than an entry at a time.

What changes between merges goes to two small dicts in front of the columns: ``young`` (written or
read by this process since the last merge, oldest first; a column entry it shadows is marked dead)
and ``front`` (objects whose deletion failed, put back as the oldest of all). When ``young`` grows
past ``young_limit`` (65,536 entries, or 1/64 of the index if larger), the tier's index thread
merges it into the columns, as it merges each relisting.

A merge runs in three steps, so the tier's lock is never held for the O(n log n) part:
:meth:`CapacityIndex.freeze` (under the lock: references and two dict copies),
:func:`rebuild` (no lock: the new columns), :meth:`CapacityIndex.install` (under the lock: the keys
this process wrote, read, deleted or evicted meanwhile keep what it knows of them, as
:meth:`CapacityIndex.begin_rebuild` started recording).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from tiercache.keys.object_key import KEY_BYTES, ObjectKey

KEY_DTYPE = np.dtype((np.void, KEY_BYTES))
#: A column entry's stamp is this process's read: a relisting keeps the later of it and S3's time.
READ = 1
#: A column entry that is gone: forgotten, evicted, or shadowed by a ``young`` entry.
DEAD = 2
#: ``young`` entries that make the index thread merge them, at least (see :func:`young_limit`).
YOUNG_MIN = 65_536
#: Sizes are kept in 32 bits: a chunk object is far below 4 GiB; a foreign object named like one
#: counts as 4 GiB - 1 at most (the bound is then loose for it, never exceeded by a chunk).
MAX_SIZE = (1 << 32) - 1

U8 = npt.NDArray[np.uint8]
U32 = npt.NDArray[np.uint32]
Keys = npt.NDArray[np.void]
V = TypeVar("V")


def _take_entries(
    entries: dict[bytes, V],
    size_of: Callable[[V], int],
    excess: int,
    skip: Callable[[ObjectKey], bool],
    victims: list[tuple[ObjectKey, int]],
) -> int:
    """Remove ``entries`` (oldest first) not ``skip``\\ ped into ``victims`` until ``excess`` bytes
    are freed; the bytes still to free."""
    for raw, entry in list(entries.items()):
        if excess <= 0:
            break
        key = ObjectKey.from_bytes(raw)
        if not skip(key):
            del entries[raw]
            victims.append((key, size_of(entry)))
            excess -= size_of(entry)
    return excess


def young_limit(entries: int) -> int:
    """How many ``young`` entries an index of ``entries`` column entries holds before a merge."""
    return max(YOUNG_MIN, entries // 64)


def _seconds(t: float) -> int:
    return min(max(int(t), 0), MAX_SIZE)


class Listing:
    """A listing of the prefix, packed as it arrives (43 bytes an object, no object per entry)."""

    def __init__(self) -> None:
        self._keys = bytearray()
        self._stamps = array("I")  # whole seconds
        self._sizes = array("I")

    def add(self, key: ObjectKey, mtime: float, size: int) -> None:
        self._keys += key.raw
        self._stamps.append(_seconds(mtime))
        self._sizes.append(min(size, MAX_SIZE))

    @classmethod
    def packed(cls, keys: bytes, mtimes: npt.NDArray[np.float64], sizes: npt.NDArray[np.uint64]) -> Listing:
        """A listing from columns already packed (35-byte keys back to back): a synthetic source."""
        if len(keys) != KEY_BYTES * len(mtimes) or len(mtimes) != len(sizes):
            raise ValueError("a packed listing needs one 35-byte key, time and size per object")
        out = cls()
        out._keys = bytearray(keys)
        out._stamps = array("I", np.clip(mtimes, 0, MAX_SIZE).astype(np.uint32).tobytes())
        out._sizes = array("I", np.minimum(sizes, MAX_SIZE).astype(np.uint32).tobytes())
        return out

    def __len__(self) -> int:
        return len(self._stamps)

    def columns(self) -> tuple[Keys, U32, U32]:
        """Keys, whole-second stamps and sizes, sorted by key; a key listed twice keeps its last entry."""
        keys = np.frombuffer(self._keys, dtype=KEY_DTYPE)  # no copies: views of the packed columns
        stamps = np.frombuffer(self._stamps, dtype=np.uint32)
        sizes = np.frombuffer(self._sizes, dtype=np.uint32)
        as_text = keys.view(f"S{KEY_BYTES}")  # compares as memcmp: the keys are all 35 bytes
        if not bool(np.all(as_text[1:] >= as_text[:-1])):  # S3 lists names in key order for one group
            by_key = np.argsort(keys, kind="stable")
            keys, stamps, sizes = keys[by_key], stamps[by_key], sizes[by_key]
        last = np.ones(len(keys), dtype=bool)
        last[:-1] = keys[1:] != keys[:-1]
        if last.all():  # S3 names each object once: no copies then
            return keys, stamps, sizes
        return keys[last], stamps[last], sizes[last]


@dataclass(slots=True)
class Columns:
    """The merged part of the index: entries sorted by key, and the order to evict them in."""

    keys: Keys
    stamps: U32  # whole seconds: S3's LastModified, or this process's write or read
    sizes: U32
    flags: U8  # READ, DEAD
    order: npt.NDArray[np.int32]  # entry indices, oldest first (stamp, then key)

    @classmethod
    def empty(cls) -> Columns:
        return cls.build(
            np.empty(0, KEY_DTYPE), np.empty(0, np.uint32), np.empty(0, np.uint32), np.empty(0, np.uint8)
        )

    @classmethod
    def build(cls, keys: Keys, stamps: U32, sizes: U32, flags: U8) -> Columns:
        """Columns of entries already sorted by key: a stable sort by stamp orders ties by key."""
        order = np.argsort(stamps, kind="stable").astype(np.int32)
        return cls(keys, stamps, sizes, flags, order)

    def find(self, raw: bytes) -> int:
        """The index of ``raw``'s entry, live or dead; -1 if it has none."""
        probe = np.frombuffer(raw, dtype=KEY_DTYPE)
        i = int(np.searchsorted(self.keys, probe)[0])
        return i if i < len(self.keys) and self.keys[i].tobytes() == raw else -1

    def live(self) -> npt.NDArray[np.bool_]:
        mask: npt.NDArray[np.bool_] = (self.flags & DEAD) == 0
        return mask

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.keys, self.stamps, self.sizes, self.flags, self.order))


@dataclass(slots=True)
class Frozen:
    """What a merge starts from (:meth:`CapacityIndex.freeze`)."""

    columns: Columns
    young: dict[bytes, tuple[float, int, bool]]
    front: dict[bytes, int]


@dataclass(slots=True)
class Rebuilt:
    """A merge's result (:func:`rebuild`), to :meth:`CapacityIndex.install`."""

    columns: Columns
    added: int = 0  # listed entries the index did not hold
    dropped: int = 0  # entries the listing lacked


class CapacityIndex:
    """Object sizes by key, oldest first (see the module docstring). Not thread-safe: the tier calls
    it under its own lock, except :func:`rebuild`, which reads only what :meth:`freeze` returned.

    While a merge runs (from :meth:`begin_rebuild` to :meth:`install` or :meth:`abandon_rebuild`;
    at start-up from construction), the keys this process writes, reads, deletes or evicts are
    recorded, so the merge cannot resurrect, resize or age them with what it saw earlier."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock  # wall clock: compared with S3's LastModified
        self._columns = Columns.empty()
        self._young: dict[bytes, tuple[float, int, bool]] = {}  # raw key → (stamp, size, read); oldest first
        self._front: dict[bytes, int] = {}  # raw key → size: deletions that failed, the oldest of all
        self._bytes = 0
        self._count = 0
        self._cursor = 0  # order positions before it hold no live, unskipped entry
        self._touched: set[bytes] | None = set()  # None while no merge runs

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return self._count

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, ObjectKey):
            return False
        raw = key.raw
        if raw in self._young or raw in self._front:
            return True
        i = self._columns.find(raw)
        return i >= 0 and not self._columns.flags[i] & DEAD

    @property
    def memory_bytes(self) -> int:
        """What the columns take (the dicts in front of them not counted: at most ``young_limit``)."""
        return self._columns.nbytes

    def wants_merge(self) -> bool:
        """Whether ``young`` has grown past its limit (the index thread then merges it)."""
        return len(self._young) > young_limit(len(self._columns.keys))

    def newest_first(self) -> list[ObjectKey]:
        """A snapshot of the keys, most recently written or read first."""
        cols = self._columns
        order = cols.order[::-1]
        live = order[(cols.flags[order] & DEAD) == 0]
        raws = [*reversed(self._young), *(k.tobytes() for k in cols.keys[live]), *reversed(self._front)]
        return ObjectKey.from_bytes_many(raws)

    # -- this process's writes, reads and deletions ------------------------------------------------
    def set(self, key: ObjectKey, size: int) -> None:
        """``key`` was just written with ``size`` bytes: the youngest entry."""
        raw = key.raw
        self._remove(raw)
        self._young[raw] = (self._clock(), min(size, MAX_SIZE), False)
        self._bytes += min(size, MAX_SIZE)
        self._count += 1
        self._touch(raw)

    def touch(self, key: ObjectKey) -> None:
        """``key`` was read: it becomes the youngest (LRU-ish)."""
        size = self._pop(key.raw)
        if size is not None:
            self._young[key.raw] = (self._clock(), size, True)
            self._touch(key.raw)

    def forget(self, key: ObjectKey) -> None:
        """``key`` is gone from the bucket."""
        self._remove(key.raw)
        self._touch(key.raw)

    def restore_oldest(self, key: ObjectKey, size: int) -> None:
        """A deletion of ``key`` failed: it is back, as the oldest, so the next eviction retries it."""
        if key not in self:
            self._front[key.raw] = min(size, MAX_SIZE)
            self._bytes += min(size, MAX_SIZE)
            self._count += 1
            self._touch(key.raw)

    def take_oldest(self, excess: int, skip: Callable[[ObjectKey], bool]) -> list[tuple[ObjectKey, int]]:
        """Remove and return the oldest entries (not ``skip``\\ ped) until ``excess`` bytes are freed."""
        victims: list[tuple[ObjectKey, int]] = []
        excess = _take_entries(self._front, lambda size: size, excess, skip, victims)
        excess = self._take_columns(excess, skip, victims)
        _take_entries(self._young, lambda entry: entry[1], excess, skip, victims)
        for key, size in victims:
            self._bytes -= size
            self._count -= 1
            self._touch(key.raw)
        return victims

    def _take_columns(
        self, excess: int, skip: Callable[[ObjectKey], bool], victims: list[tuple[ObjectKey, int]]
    ) -> int:
        """Take column entries in order from the cursor; the cursor stops at the first one skipped."""
        cols = self._columns
        pos, stop = self._cursor, len(cols.order)
        first_skipped = -1
        while excess > 0 and pos < stop:
            i = int(cols.order[pos])
            pos += 1
            if cols.flags[i] & DEAD:
                continue
            key = ObjectKey.from_bytes(cols.keys[i].tobytes())
            if skip(key):
                first_skipped = pos - 1 if first_skipped < 0 else first_skipped
                continue
            cols.flags[i] |= DEAD
            size = int(cols.sizes[i])
            victims.append((key, size))
            excess -= size
        self._cursor = first_skipped if first_skipped >= 0 else pos
        return excess

    def _remove(self, raw: bytes) -> None:
        size = self._pop(raw)
        if size is not None:
            self._bytes -= size
            self._count -= 1

    def _pop(self, raw: bytes) -> int | None:
        """Take ``raw``'s entry out of wherever it is (a column entry is marked dead); its size, or
        None if the index does not hold it."""
        if raw in self._young:
            return self._young.pop(raw)[1]
        if raw in self._front:
            return self._front.pop(raw)
        i = self._columns.find(raw)
        if i < 0 or self._columns.flags[i] & DEAD:
            return None
        self._columns.flags[i] |= DEAD
        return int(self._columns.sizes[i])

    def _touch(self, raw: bytes) -> None:
        if self._touched is not None:
            self._touched.add(raw)

    # -- merges ------------------------------------------------------------------------------------
    def begin_rebuild(self) -> None:
        """A merge starts (a listing of the prefix, or ``young`` grown past its limit)."""
        self._touched = set()

    def abandon_rebuild(self) -> None:
        """The merge's listing failed: keep the index as it is."""
        self._touched = None

    def freeze(self) -> Frozen:
        """What :func:`rebuild` merges: the columns (not copied: only this thread replaces them, and
        flags changed meanwhile belong to recorded keys) and copies of the two dicts."""
        return Frozen(self._columns, dict(self._young), dict(self._front))

    def install(self, rebuilt: Rebuilt) -> None:
        """Take the merged columns; the keys recorded since :meth:`begin_rebuild` keep what this
        process knows of them (its ``young`` and ``front`` entries, or their absence)."""
        touched = self._touched or set()
        cols = rebuilt.columns
        for raw in touched:
            i = cols.find(raw)
            if i >= 0:
                cols.flags[i] |= DEAD
        self._young = {k: v for k, v in self._young.items() if k in touched}
        self._front = {k: v for k, v in self._front.items() if k in touched}
        self._columns = cols
        live = cols.live()
        self._bytes = (
            int(cols.sizes[live].sum(dtype=np.uint64))
            + sum(v[1] for v in self._young.values())
            + sum(self._front.values())
        )
        self._count = int(live.sum()) + len(self._young) + len(self._front)
        self._cursor = 0
        self._touched = None


def rebuild(frozen: Frozen, listing: Listing | None, *, drop_unlisted: bool) -> Rebuilt:
    """Merge ``frozen``'s dicts into its columns and, given a ``listing`` of the prefix, reconcile
    them with it: listed keys the index lacks were written by other nodes (added); keys the listing
    lacks were deleted by them (dropped, with ``drop_unlisted``). Every listed key is then aged by
    S3's time for it, or this process's last read if later, ties by key: the same order on every node
    that lists the same objects, so nodes evicting down to one capacity evict the same objects.
    Pure: reads ``frozen`` only (no lock). The columns and a listing in S3's order are sorted
    already, so a merge costs searches and one sort by age, never a sort of the keys."""
    held = _held(frozen)
    if listing is None:
        return Rebuilt(Columns.build(*held))
    keys, stamps, sizes, flags = held
    l_keys, l_stamps, l_sizes = listing.columns()
    at = np.searchsorted(keys, l_keys)
    listed_held = _found(keys, l_keys, at)
    held_listed = np.zeros(len(keys), dtype=bool)
    held_listed[at[listed_held]] = True
    # Held and listed: S3's time, or this process's read if later; the size this process knows.
    hit = at[listed_held]
    read = (flags[hit] & READ) != 0
    stamps = stamps.copy()
    stamps[hit] = np.where(read, np.maximum(stamps[hit], l_stamps[listed_held]), l_stamps[listed_held])
    keep = held_listed | (not drop_unlisted)
    new = ~listed_held
    merged = _insert_sorted(
        (keys[keep], stamps[keep], sizes[keep], flags[keep]),
        (l_keys[new], l_stamps[new], l_sizes[new], np.zeros(int(new.sum()), np.uint8)),
    )
    return Rebuilt(Columns.build(*merged), added=int(new.sum()), dropped=int((~keep).sum()))


Cols = tuple[Keys, U32, U32, U8]


def _found(keys: Keys, probes: Keys, at: npt.NDArray[np.intp]) -> npt.NDArray[np.bool_]:
    """Which ``probes`` are in the sorted ``keys`` (``at``: their ``searchsorted`` positions)."""
    found = np.zeros(len(probes), dtype=bool)
    inside = at < len(keys)
    found[inside] = keys[at[inside]] == probes[inside]
    return found


def _insert_sorted(into: Cols, new: Cols) -> Cols:
    """Both sorted by key, no key in both: the union, sorted by key (O(n), no sort of ``into``)."""
    if not len(new[0]):
        return into
    at = np.searchsorted(into[0], new[0])
    return (
        np.insert(into[0], at, new[0]),
        np.insert(into[1], at, new[1]),
        np.insert(into[2], at, new[2]),
        np.insert(into[3], at, new[3]),
    )


def _sorted_by_key(cols: Cols) -> Cols:
    by_key = np.argsort(cols[0], kind="stable")
    return cols[0][by_key], cols[1][by_key], cols[2][by_key], cols[3][by_key]


def _held(frozen: Frozen) -> Cols:
    """Every entry ``frozen`` holds as columns sorted by key: the live column entries, and ``young``
    (stamped when written or read) and ``front`` (stamped 0: the oldest) inserted among them."""
    cols = frozen.columns
    live = cols.live()
    young, front = frozen.young, frozen.front
    extra = _sorted_by_key(
        (
            np.frombuffer(b"".join([*young, *front]), dtype=KEY_DTYPE),
            np.array([*(_seconds(v[0]) for v in young.values()), *(0 for _ in front)], dtype=np.uint32),
            np.array([*(v[1] for v in young.values()), *front.values()], dtype=np.uint32),
            np.array([*(READ if v[2] else 0 for v in young.values()), *(0 for _ in front)], dtype=np.uint8),
        )
    )
    keys = cols.keys[live]
    # A young key whose column entry is live (never, as the index keeps them): the young one wins.
    shadowed = np.ones(len(keys), dtype=bool)
    at = np.searchsorted(keys, extra[0])
    shadowed[at[_found(keys, extra[0], at)]] = False
    kept = (
        keys[shadowed],
        cols.stamps[live][shadowed],
        cols.sizes[live][shadowed],
        (cols.flags[live] & np.uint8(READ))[shadowed],
    )
    return _insert_sorted(kept, extra)


__all__ = ["CapacityIndex", "Columns", "Listing", "Rebuilt", "rebuild", "young_limit"]
