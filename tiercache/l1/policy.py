"""L1 eviction policies: which committed object leaves when a reservation needs room.

A policy only orders keys; the tier decides what *may* go (``can_evict`` says no for pinned objects
and for objects still owed to a lower tier) and frees the bytes. Policies are not thread-safe; the
tier calls them under its lock, on the request path, so every hook is O(1) amortised. ``evict_one``
skips keys that may not go, so its cost grows with the number of pinned/owed keys it passes; it gives
up (returns ``None``) after a bounded number of steps, and the tier then reports the arena full.

Two policies, chosen by :class:`~tiercache.config.EvictionPolicyName`:

* **LRU** (default): evict the least recently committed or pinned object. Simple and predictable.
* **S3-FIFO** (Yang et al., SOSP 2023): a small FIFO (~10% of objects) that every new object enters,
  a main FIFO, and a "ghost" FIFO of keys recently evicted from the small queue. An object leaves the
  small queue to the main one only if it was used while there (or its key was a ghost); the main queue
  gives each object as many extra rounds as it had accesses (capped at 3). Why it is the
  frequency-aware choice here:

  - *scan resistant*: a burst of one-off prompts passes through the small queue and is evicted from
    there, so it cannot flush the hot shared prefixes (system prompts, few-shot headers) that every
    request reuses — exactly the failure LRU has under a batch of unique long prompts;
  - *O(1)* per operation with no per-access list reordering (an access bumps a small counter);
  - *simple*: three ordered dicts and a counter, easy to reason about and to test.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

from tiercache.config.parts import EvictionPolicyName
from tiercache.errors import ConfigError

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(ABC, Generic[K]):
    """Orders the committed keys of a tier for eviction. Called under the tier's lock."""

    @abstractmethod
    def on_insert(self, key: K) -> None:
        """``key`` was committed (and is not tracked yet)."""

    @abstractmethod
    def on_access(self, key: K) -> None:
        """``key`` was read (pinned). Untracked keys are ignored."""

    def on_access_many(self, keys: Iterable[K]) -> None:
        """:meth:`on_access` of each of ``keys``, in order (a ticket's release reads 64 objects for a
        16k-token prompt at once: a policy may do it in one loop of its own)."""
        for key in keys:
            self.on_access(key)

    @abstractmethod
    def on_remove(self, key: K) -> None:
        """``key`` left the tier for a reason other than this policy (delete, overwrite)."""

    @abstractmethod
    def evict_one(self, can_evict: Callable[[K], bool]) -> K | None:
        """Choose a victim for which ``can_evict`` is true, stop tracking it and return it.

        ``None`` when no tracked key may be evicted (all pinned or owed, or nothing tracked).
        """

    @abstractmethod
    def __len__(self) -> int:
        """Number of tracked keys."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is tracked."""


class LRUPolicy(EvictionPolicy[K]):
    """Least recently used first; a read or a commit makes a key most recent."""

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()  # oldest first

    def on_insert(self, key: K) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: K) -> None:
        try:  # one hash of the key, not two: a key read is almost always tracked
            self._order.move_to_end(key)
        except KeyError:
            pass

    def on_access_many(self, keys: Iterable[K]) -> None:
        keys = list(keys)
        move = self._order.move_to_end
        try:
            deque(map(move, keys), maxlen=0)  # the loop in C: every key read is almost always tracked
        except KeyError:  # one was not: those before it moved; the rest one by one, skipping it
            for key in keys:
                try:
                    move(key)
                except KeyError:
                    pass

    def on_remove(self, key: K) -> None:
        self._order.pop(key, None)

    def evict_one(self, can_evict: Callable[[K], bool]) -> K | None:
        # Walks past pinned/owed keys without reordering them: they keep their age and go as soon
        # as they are released/settled.
        for key in self._order:
            if can_evict(key):
                del self._order[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class S3FIFOPolicy(EvictionPolicy[K]):
    """S3-FIFO: small probationary FIFO, main FIFO with reinsertion, ghost FIFO of recent evictees."""

    #: Accesses remembered per object; each gives one extra round in the main queue.
    MAX_FREQ = 3

    def __init__(self, small_fraction: float = 0.1) -> None:
        if not 0 < small_fraction < 1:
            raise ValueError(f"small_fraction must be in (0, 1), got {small_fraction}")
        self._small_fraction = small_fraction
        self._small: OrderedDict[K, int] = OrderedDict()  # key -> freq, oldest first
        self._main: OrderedDict[K, int] = OrderedDict()  # key -> freq, oldest first
        self._ghost: OrderedDict[K, None] = OrderedDict()  # keys evicted from small, oldest first

    def on_insert(self, key: K) -> None:
        if key in self._ghost:
            # Seen recently and evicted too early: it has proven reuse, skip probation.
            del self._ghost[key]
            self._main[key] = 0
        else:
            self._small[key] = 0

    def on_access(self, key: K) -> None:
        if key in self._small:
            self._small[key] = min(self._small[key] + 1, self.MAX_FREQ)
        elif key in self._main:
            self._main[key] = min(self._main[key] + 1, self.MAX_FREQ)

    def on_remove(self, key: K) -> None:
        self._small.pop(key, None)
        self._main.pop(key, None)

    def evict_one(self, can_evict: Callable[[K], bool]) -> K | None:
        # Every step either evicts, moves a key small -> main, or lowers a main key's counter or
        # rotates a non-evictable one; this bound lets each key be looked at MAX_FREQ + 2 times.
        steps = (self.MAX_FREQ + 2) * (len(self._small) + len(self._main)) + 1
        while steps > 0 and (self._small or self._main):
            steps -= 1
            if self._small and (len(self._small) >= self._small_target() or not self._main):
                key, freq = self._small.popitem(last=False)
                if freq > 0 or not can_evict(key):
                    # Used while on probation (or in use right now): promote.
                    self._main[key] = freq
                    continue
                self._remember_ghost(key)
                return key
            key, freq = self._main.popitem(last=False)
            if not can_evict(key):
                self._main[key] = freq  # rotate without spending its credit
            elif freq > 0:
                self._main[key] = freq - 1  # reinsert: one more round per remembered access
            else:
                return key
        return None

    def _small_target(self) -> int:
        total = len(self._small) + len(self._main)
        return max(1, int(total * self._small_fraction))

    def _remember_ghost(self, key: K) -> None:
        self._ghost[key] = None
        self._ghost.move_to_end(key)
        # The ghost remembers about as many keys as the cache holds; older ones are forgotten.
        limit = max(1, len(self._small) + len(self._main))
        while len(self._ghost) > limit:
            self._ghost.popitem(last=False)

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._main


def make_policy(name: EvictionPolicyName | str) -> EvictionPolicy[K]:
    """The policy for a config value (``"lru"`` or ``"s3fifo"``)."""
    try:
        which = EvictionPolicyName(name)
    except ValueError:
        choices = ", ".join(p.value for p in EvictionPolicyName)
        raise ConfigError(f"unknown L1 eviction policy {name!r}; choose one of: {choices}") from None
    if which is EvictionPolicyName.S3FIFO:
        return S3FIFOPolicy()
    return LRUPolicy()
