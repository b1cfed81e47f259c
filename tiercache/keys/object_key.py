"""ObjectKey: the one identity of a stored chunk, on every tier.

``ObjectKey = (fingerprint, object_group, prefix_hash)``. Built by :meth:`ObjectKey.from_bytes` /
:meth:`ObjectKey.parse` and encoded by :meth:`ObjectKey.to_bytes` / :meth:`ObjectKey.text`; nothing
else builds or parses keys, and keys are never pickled.

Byte form (35 bytes): ``version(1) | fingerprint(16) | object_group(u16 big-endian) | prefix_hash(16)``.
The fingerprint comes first so that LMDB keeps one engine layout's objects together and a range scan
lists them. Text form: ``<fingerprint hex>/g<group>/<prefix hash hex>`` — used as the S3 object name
(under the configured prefix) and by the CLI.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import itemgetter
from typing import Any

from tiercache.errors import KeyFormatError
from tiercache.keys.fingerprint import FINGERPRINT_BYTES, Fingerprint
from tiercache.keys.hashing import HASH_BYTES

KEY_VERSION = 1
KEY_BYTES = 1 + FINGERPRINT_BYTES + 2 + HASH_BYTES
MAX_OBJECT_GROUP = 0xFFFF
_TEXT = re.compile(r"^([0-9a-f]{32})/g(\d{1,5})/([0-9a-f]{32})$")
_HEAD = itemgetter(slice(0, 1 + FINGERPRINT_BYTES + 2))  # version, fingerprint, group
_IS_BYTES = bytes.__instancecheck__
_VERSION = itemgetter(0)
_HASH_PART = itemgetter(slice(1 + FINGERPRINT_BYTES + 2, None))
_GROUP_PART = itemgetter(slice(1 + FINGERPRINT_BYTES, 1 + FINGERPRINT_BYTES + 2))


@dataclass(frozen=True, slots=True, order=True)
class ObjectKey:
    """Where one chunk of one object group of one engine layout lives, on every tier."""

    fingerprint: Fingerprint
    object_group: int
    prefix_hash: bytes
    # Keys are hashed and encoded on every index, lease and frame operation: compute both once.
    _hash: int = field(init=False, repr=False, compare=False)
    #: The 35-byte binary form (what :meth:`to_bytes` returns), as a plain attribute: L1 indexes
    #: objects by it, so a lookup hashes and compares bytes instead of calling Python methods.
    raw: bytes = field(init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        # The 35-byte form holds every field: one bytes comparison instead of three field compares.
        if other.__class__ is not ObjectKey:
            return NotImplemented
        return self.raw == other.raw

    def __post_init__(self) -> None:
        head = _head(self.fingerprint, self.object_group)
        if len(self.prefix_hash) != HASH_BYTES:
            raise KeyFormatError(f"a prefix hash is {HASH_BYTES} bytes, got {len(self.prefix_hash)}")
        raw = head + self.prefix_hash
        object.__setattr__(self, "raw", raw)
        object.__setattr__(self, "_hash", hash(raw))

    def to_bytes(self) -> bytes:
        """The 35-byte binary form used as the LMDB key and inside object frames."""
        return self.raw

    @classmethod
    def many(cls, fingerprint: Fingerprint, object_group: int, hashes: Sequence[bytes]) -> list[ObjectKey]:
        """The keys of ``hashes`` in one group: what ``[ObjectKey(fingerprint, object_group, h) ...]``
        gives, in a fraction of the time (a lookup of a 128k-token prompt builds 512 per group on
        the server's hot path). The group is checked once and each hash's length; the fields are
        set through the slots' own descriptors in C loops, skipping the frozen dataclass's
        per-field ``object.__setattr__``."""
        if cls is not ObjectKey:
            return [cls(fingerprint, object_group, h) for h in hashes]
        raws = ObjectKey.raw_under(_head(fingerprint, object_group), hashes)  # checks the lengths
        return _under_one_head(raws, fingerprint, object_group)

    @staticmethod
    def raw_many(fingerprint: Fingerprint, object_group: int, hashes: Sequence[bytes]) -> list[bytes]:
        """The binary forms of :meth:`many`'s keys, without building the keys (checked as
        :meth:`many` checks): what an index keyed by :attr:`raw` is asked with."""
        return ObjectKey.raw_under(_head(fingerprint, object_group), hashes)

    @staticmethod
    def raw_head(fingerprint: Fingerprint, object_group: int) -> bytes:
        """The first bytes of the binary form of every key of ``object_group`` under
        ``fingerprint`` (what :meth:`raw_under` takes); raises :class:`KeyFormatError` for a group
        outside the range. Kept by whoever asks for one group's keys on every request."""
        return _head(fingerprint, object_group)

    @staticmethod
    def raw_under(head: bytes, hashes: Sequence[bytes]) -> list[bytes]:
        """:meth:`raw_many` for the group whose :meth:`raw_head` is ``head``."""
        if not set(map(len, hashes)) <= {HASH_BYTES}:  # the lengths gathered in C
            bad = next(h for h in hashes if len(h) != HASH_BYTES)
            raise KeyFormatError(f"a prefix hash is {HASH_BYTES} bytes, got {len(bad)}")
        return [head + h for h in hashes]

    @classmethod
    def from_bytes(cls, raw: bytes | memoryview) -> ObjectKey:
        """Parse the binary form; raises :class:`KeyFormatError` on anything else."""
        raw = bytes(raw)
        if len(raw) != KEY_BYTES:
            raise KeyFormatError(f"an object key is {KEY_BYTES} bytes, got {len(raw)}")
        if raw[0] != KEY_VERSION:
            raise KeyFormatError(f"object key version {raw[0]} is not {KEY_VERSION}")
        fp_end = 1 + FINGERPRINT_BYTES
        return cls(
            Fingerprint(raw[1:fp_end]),
            int.from_bytes(raw[fp_end : fp_end + 2], "big"),
            raw[fp_end + 2 :],
        )

    @classmethod
    def from_bytes_many(cls, raws: Sequence[bytes]) -> list[ObjectKey]:
        """:meth:`from_bytes` of each of ``raws`` (checked the same), built as :meth:`many` builds
        keys, with one :class:`Fingerprint` per distinct fingerprint: a pin of 128 pages parses 128
        keys of one or two fingerprints on the server's request loop."""
        if cls is not ObjectKey:
            return [cls.from_bytes(raw) for raw in raws]
        fp_end = 1 + FINGERPRINT_BYTES
        head_end = fp_end + 2
        if all(map(_IS_BYTES, raws)) and set(map(len, raws)) == {KEY_BYTES}:
            one_head = set(map(_HEAD, raws))
            if len(one_head) == 1:  # the usual store: one engine layout's group; the loops in C
                (head,) = one_head
                if head[0] == KEY_VERSION:
                    fingerprint = Fingerprint(head[1:fp_end])
                    return _under_one_head(raws, fingerprint, int.from_bytes(head[fp_end:head_end], "big"))
        heads: dict[bytes, tuple[Fingerprint, int]] = {}  # a request's keys share one or two heads
        new = object.__new__
        set_fp, set_group, set_hash = _FINGERPRINT.__set__, _GROUP.__set__, _PREFIX.__set__
        set_raw, set_code = _RAW.__set__, _CODE.__set__
        out: list[ObjectKey] = []
        for raw in raws:
            if len(raw) != KEY_BYTES or raw[0] != KEY_VERSION:
                out.append(cls.from_bytes(raw))  # raises, naming what is wrong
                continue
            raw = bytes(raw)
            head = raw[:head_end]
            parsed = heads.get(head)
            if parsed is None:
                parsed = heads[head] = (
                    Fingerprint(raw[1:fp_end]),
                    int.from_bytes(raw[fp_end:head_end], "big"),
                )
            key = new(cls)
            set_fp(key, parsed[0])
            set_group(key, parsed[1])
            set_hash(key, raw[head_end:])
            set_raw(key, raw)
            set_code(key, hash(raw))
            out.append(key)
        return out

    @classmethod
    def check_many(cls, raws: Sequence[bytes]) -> None:
        """Raise :class:`KeyFormatError` (as :meth:`from_bytes` would) unless every one of ``raws``
        is a key's binary form, as ``bytes``, without building the keys: a pin looks its keys up
        by that form (the checks run in C)."""
        if (
            all(map(_IS_BYTES, raws))
            and set(map(len, raws)) <= {KEY_BYTES}
            and set(map(_VERSION, raws)) <= {KEY_VERSION}
        ):
            return
        for raw in raws:
            if not isinstance(raw, bytes):  # (from_bytes would copy it; a lookup by it cannot)
                raise KeyFormatError(f"an object key is bytes, got {type(raw).__name__}")
            cls.from_bytes(raw)  # raises, naming what is wrong

    @staticmethod
    def group_and_hash(raw: bytes) -> tuple[int, bytes]:
        """The object group and prefix hash of a binary key, without building the key (a lookup's
        reply holds one per object: 512 for a 128k-token prompt); checked as :meth:`from_bytes`."""
        if len(raw) != KEY_BYTES or raw[0] != KEY_VERSION:
            raise KeyFormatError(
                f"not a version-{KEY_VERSION} object key of {KEY_BYTES} bytes: {len(raw)} bytes"
            )
        at = 1 + FINGERPRINT_BYTES
        return int.from_bytes(raw[at : at + 2], "big"), bytes(raw[at + 2 :])

    @staticmethod
    def groups_and_hashes(raws: Sequence[bytes]) -> list[tuple[int, bytes]]:
        """:meth:`group_and_hash` of each of ``raws`` (checked the same), in C loops: the connector's
        scheduler maps every slot of a lookup's reply by it, on the engine's thread (512 for a
        128k-token prompt)."""
        if (
            all(map(_IS_BYTES, raws))
            and set(map(len, raws)) <= {KEY_BYTES}
            and set(map(_VERSION, raws)) <= {KEY_VERSION}
        ):
            # (int.from_bytes reads big-endian by default: the key's byte order)
            return list(zip(map(int.from_bytes, map(_GROUP_PART, raws)), map(_HASH_PART, raws)))
        return [ObjectKey.group_and_hash(raw) for raw in raws]  # raises, naming what is wrong

    def text(self) -> str:
        """The printable form ``<fingerprint>/g<group>/<prefix hash>``."""
        return f"{self.fingerprint.hex}/g{self.object_group}/{self.prefix_hash.hex()}"

    @classmethod
    def parse(cls, text: str) -> ObjectKey:
        """Parse :meth:`text`; raises :class:`KeyFormatError` naming the expected form."""
        m = _TEXT.match(text.strip())
        if not m:
            raise KeyFormatError(f"{text!r} is not an object key; expected <32 hex>/g<group>/<32 hex>")
        return cls(Fingerprint.from_hex(m.group(1)), int(m.group(2)), bytes.fromhex(m.group(3)))

    def __str__(self) -> str:
        return self.text()


def _under_one_head(raws: Sequence[bytes], fingerprint: Fingerprint, object_group: int) -> list[ObjectKey]:
    """The keys of ``raws`` (checked: 35 bytes each, every one of ``fingerprint`` and
    ``object_group``), each field set by its slot's descriptor in a C loop (~0.7 µs a key
    instead of ~1.1 in a Python loop)."""
    n = len(raws)
    keys: list[ObjectKey] = list(map(object.__new__, repeat(ObjectKey, n)))
    for descriptor, values in (
        (_FINGERPRINT, repeat(fingerprint, n)),
        (_GROUP, repeat(object_group, n)),
        (_PREFIX, map(_HASH_PART, raws)),
        (_RAW, raws),
        (_CODE, map(hash, raws)),
    ):
        deque(map(descriptor.__set__, keys, values), maxlen=0)
    return keys


def _head(fingerprint: Fingerprint, object_group: int) -> bytes:
    """The first 19 bytes of every key of ``object_group`` under ``fingerprint`` (version,
    fingerprint, group); raises :class:`KeyFormatError` for a group outside the range."""
    if not 0 <= object_group <= MAX_OBJECT_GROUP:
        raise KeyFormatError(f"object group {object_group} is outside 0..{MAX_OBJECT_GROUP}")
    return bytes((KEY_VERSION,)) + fingerprint.raw + object_group.to_bytes(2, "big")


# The slots' descriptors, for ObjectKey.many.
_FINGERPRINT: Any = ObjectKey.__dict__["fingerprint"]
_GROUP: Any = ObjectKey.__dict__["object_group"]
_PREFIX: Any = ObjectKey.__dict__["prefix_hash"]
_RAW: Any = ObjectKey.__dict__["raw"]
_CODE: Any = ObjectKey.__dict__["_hash"]
