"""Object groups as the engine's lookups see them, and the keys a restorable prefix needs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tiercache.keys import restore
from tiercache.keys.fingerprint import Fingerprint, GroupKind
from tiercache.keys.object_key import ObjectKey


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One object group of a registered engine layout, as the lookup rule needs it.

    ``window_chunks`` is, for a sliding-window group, how many trailing chunks a boundary needs
    (see :meth:`sliding`); it is ignored for the other kinds.
    """

    object_group: int
    kind: GroupKind
    fingerprint: Fingerprint
    window_chunks: int = 0
    #: :meth:`ObjectKey.raw_head <tiercache.keys.ObjectKey.raw_head>` of the group's keys: every
    #: lookup asks for them in their binary form.
    raw_head: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "raw_head", ObjectKey.raw_head(self.fingerprint, self.object_group))

    @classmethod
    def sliding(
        cls, object_group: int, fingerprint: Fingerprint, window_tokens: int, chunk_size: int
    ) -> GroupSpec:
        """A sliding-window group: the window's tokens span ``ceil(window / chunk)`` whole chunks."""
        return cls(
            object_group,
            GroupKind.SLIDING_WINDOW,
            fingerprint,
            restore.window_chunks(window_tokens, chunk_size),
        )

    def key(self, prefix_hash: bytes) -> ObjectKey:
        """The object key of this group's object for the chunk ending in ``prefix_hash``."""
        return ObjectKey(self.fingerprint, self.object_group, prefix_hash)

    def needed(self, hashes: Sequence[bytes], boundary: int) -> list[ObjectKey]:
        """Keys this group needs to restore the first ``boundary`` chunks (:mod:`tiercache.keys.restore`)."""
        chunks = restore.needed_chunks(self.kind, boundary, self.window_chunks)
        return ObjectKey.many(self.fingerprint, self.object_group, hashes[chunks.start : chunks.stop])

    def needed_raw(self, hashes: Sequence[bytes], boundary: int) -> list[bytes]:
        """:meth:`needed`'s keys in their binary form (:attr:`ObjectKey.raw`), without building them."""
        chunks = restore.needed_chunks(self.kind, boundary, self.window_chunks)
        return ObjectKey.raw_under(self.raw_head, hashes[chunks.start : chunks.stop])


def needed_keys(groups: Sequence[GroupSpec], hashes: Sequence[bytes], boundary: int) -> list[ObjectKey]:
    """Every key needed to restore ``boundary`` chunks for all ``groups``."""
    return [key for g in groups for key in g.needed(hashes, boundary)]
