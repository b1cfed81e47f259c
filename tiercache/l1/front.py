"""What the server needs of its first tier beyond the tier contract: a shared arena that the
clients' processes map, and where each reservation's and lease's bytes lie in it.

The tier contract (:class:`~tiercache.tier.FrontTier`) names what the engine asks of any first tier,
batches included (``reserve_many``, ``pin_many``, ``release_many``). The server's data path also
hands clients slots in the arena and takes back what an abandoned writer left: those calls are
named here, as :class:`ArenaFront`, so the server depends on them and not on
:class:`~tiercache.l1.tier.L1Tier` (the one implementation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from tiercache.config.parts import L1Config
from tiercache.keys.object_key import ObjectKey
from tiercache.l1.arena import ArenaSlot, SharedArena
from tiercache.l1.core import Abandoned, L1Stats
from tiercache.l1.slots import HeldColumns
from tiercache.tier.contract import HeldSet, ReadHandle, WriteHandle

T = TypeVar("T")


class ArenaFront(Protocol):
    """A first tier whose objects lie in a shared arena (see the module docstring). Every call is
    non-blocking and may run on the server's request loop."""

    @property
    def arena(self) -> SharedArena:
        """This process's mapping of the arena."""
        ...

    @property
    def arena_name(self) -> str:
        """The name clients attach the arena by."""
        ...

    @property
    def config(self) -> L1Config: ...

    @property
    def stats(self) -> L1Stats: ...

    def reserve_many(
        self, items: Sequence[tuple[ObjectKey, int]], *, tenants: Sequence[bytes] = ()
    ) -> list[WriteHandle]:
        """As :meth:`FrontTier.reserve_many <tiercache.tier.FrontTier.reserve_many>`."""
        ...

    def pin_many(self, keys: Sequence[ObjectKey], *, count: bool = True) -> list[ReadHandle | None]: ...

    def pin_all(self, raws: Sequence[bytes]) -> HeldSet | None:
        """As :meth:`FrontTier.pin_all <tiercache.tier.FrontTier.pin_all>`."""
        ...

    def release_all(self, held: HeldSet, *, read: bool = False) -> int:
        """As :meth:`FrontTier.release_all <tiercache.tier.FrontTier.release_all>`."""
        ...

    def pin_many_raw(self, raws: Sequence[bytes]) -> list[ReadHandle | None]:
        """:meth:`pin_many` of keys in their binary form (``ObjectKey.to_bytes()``, checked by the
        caller), counted as reads: a pin request's keys are looked up as they came, no key object
        built for each."""
        ...

    def release_many(self, handles: Sequence[ReadHandle], *, read: bool = False) -> list[bool]: ...

    def slot_of(self, handle: WriteHandle | ReadHandle) -> ArenaSlot:
        """Where an open reservation's or lease's bytes lie."""
        ...

    def lease_slots(
        self, handles: Sequence[ReadHandle], build: Callable[[bytes, int, int, int, int], T]
    ) -> list[T]:
        """``build(key bytes, offset, nbytes, token, digest)`` of each open lease, in one call."""
        ...

    def reservation_slots(
        self, handles: Sequence[WriteHandle], build: Callable[[bytes, int, int, int], T]
    ) -> list[T]:
        """``build(key bytes, offset, nbytes, token)`` of each open reservation, in one call."""
        ...

    def held_slots(
        self, held: HeldSet, build: Callable[[bytes, int, int, int, int], T], *, count: bool = False
    ) -> list[T]:
        """:meth:`lease_slots` of a :meth:`FrontTier.pin_all <tiercache.tier.FrontTier.pin_all>`
        hold, every slot under the hold's token; ``count``: the objects are read now (a client's
        pin), counted as hits."""
        ...

    def held_columns(self, held: HeldSet) -> HeldColumns:
        """:meth:`held_slots` field by field (every slot under the hold's token)."""
        ...

    def abandon_many(self, handles: Sequence[WriteHandle]) -> None:
        """End reservations whose writer may still write (its session was dropped)."""
        ...

    def release_quarantined(self, tokens: Sequence[int]) -> int:
        """The writer of these abandoned reservations is done with them: free their slots."""
        ...

    def abandoned_over(self, offset: int, nbytes: int) -> list[Abandoned]:
        """The abandoned reservations whose slot overlapped these bytes, newest first."""
        ...


__all__ = ["ArenaFront"]
