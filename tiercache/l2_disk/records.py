"""The disk tier's on-disk format: its sub-databases, record keys and record layouts.

Layout version 3: one LMDB environment with three named sub-databases::

    data       object key (35 B)       -> stored payload (compressed when the frame says so)
    meta       object key (35 B)       -> frame header (75 B) | recency seq (u64 BE) | flags (u8)
               0xFD 'T' object key     -> tenant id (8 B)   (only objects of a named tenant)
               0xFE 'I' name           -> u64 BE       (bytes_used, next_seq, format)
               0xFE 'I' 't:' tenant id -> bytes u64 BE | objects u64 BE  (per named tenant)
               0xFE 'I' 's:' name      -> the engine's state of that name (the tail block index)
               0xFF 'R' seq (u64 BE)   -> object key   (LRU order: the first record is the oldest)
    manifests  fingerprint (16 B)      -> manifest JSON (LayoutManifest.canonical(), for `inspect`)

Recency, tenant and info records share the meta B-tree under prefixes that sort after every object
key (object keys start with their version byte, 0x01): a put then dirties two leaf pages instead of
four (measured: four sub-databases cost ~20% of raw LMDB put throughput at 256 KiB, this layout ~5%).
Objects of the default tenant (no cache salt) have no tenant record, and its totals are what the
named tenants' leave of ``bytes_used`` and the object count, so an unsalted put writes nothing more.
Version 3 only added the tenant records: a version-2 environment is a valid one whose objects are
all the default tenant's, and is upgraded in place when a server opens it. The state records came
later, within version 3: a build that does not know them never reads them.
The flags byte has one bit, :data:`TENANT_FLAG`: the object has a tenant record (layout 2 once
marked objects owed to a lower tier there; layout 2 wrote 0, no tenant record, so its meta records
read right in layout 3). ``bytes_used`` counts the *stored* bytes in ``data``; the object count is the entry count
of ``data``.

Shared by the tier (its :mod:`~tiercache.l2_disk.store` writes this format; its read path and eviction
walk read it) and the read-only reader (:mod:`tiercache.l2_disk.reader`) of ``tiercache inspect``.
Records are built and taken apart by the codec functions below, not sliced by hand elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lmdb
import xxhash

from tiercache.tier.frames import HEADER_BYTES

#: Version of the layout above. Bumped when it changes; a mismatch refuses to open.
DISK_FORMAT_VERSION = 3
#: Older layouts this build opens as they are (and upgrades, when it may write).
UPGRADABLE_FORMATS = (2,)
#: The named sub-databases (recency and info records live in ``meta``).
DB_NAMES = ("data", "meta", "manifests")

SEQ_BYTES = 8
#: A meta record: frame header | recency seq | flags.
META_BYTES = HEADER_BYTES + SEQ_BYTES + 1
#: The meta record's flags byte.
META_FLAGS = b"\x00"
#: The flags bit of an object that has a tenant record (so an unsalted object's overwrite or eviction
#: need not look for one).
TENANT_FLAG = 0x01
REC = b"\xffR"  # REC + seq (u64 BE) -> object key: the LRU order, oldest first
TEN = b"\xfdT"  # TEN + object key -> tenant id, for objects of a named tenant
INFO = b"\xfeI"
INFO_USED = INFO + b"bytes_used"
INFO_SEQ = INFO + b"next_seq"
INFO_FORMAT = INFO + b"format"
INFO_TENANT = INFO + b"t:"  # INFO_TENANT + tenant id -> bytes | objects (u64 BE each)
INFO_STATE = INFO + b"s:"  # INFO_STATE + name -> an engine state blob (Tier.put_state)
#: First byte of the prefixed records above; never an object key's.
FIRST_RESERVED = 0xFD
#: Records per read transaction while scanning.
ITER_BATCH = 1024
#: Reader slots of the environment (the tier's leases and the inspector share them).
MAX_READERS = 512

_HEADER_BODY = HEADER_BYTES - 8
_STORED_LEN_AT = _HEADER_BODY - 16  # the stored-length field: ... | stored len u64 | checksum u64
_SEQ_END = HEADER_BYTES + SEQ_BYTES
_NAMED_FLAGS = bytes((META_FLAGS[0] | TENANT_FLAG,))


def u64(raw: bytes | memoryview | None) -> int:
    """A big-endian u64 record value (0 when absent)."""
    return 0 if raw is None else int.from_bytes(raw, "big")


def b64(value: int) -> bytes:
    """``value`` as a big-endian u64 record value or key part."""
    return value.to_bytes(8, "big")


def recency_key(seqb: bytes) -> bytes:
    """The recency record's key for a sequence number (u64 BE)."""
    return REC + seqb


def recency_seq(rkey: bytes) -> bytes:
    """The sequence number (u64 BE) of the recency record keyed ``rkey``."""
    return rkey[len(REC) :]


def tenant_key(kb: bytes) -> bytes:
    """The key of the tenant record of object ``kb``."""
    return TEN + kb


def totals_key(tenant: bytes) -> bytes:
    """The key of a named tenant's totals record."""
    return INFO_TENANT + tenant


def state_key(name: str) -> bytes:
    """The key of the engine state record ``name``."""
    return INFO_STATE + name.encode()


def pack_totals(nbytes: int, objects: int) -> bytes:
    """A tenant's totals record: stored bytes | objects."""
    return b64(nbytes) + b64(objects)


def unpack_totals(raw: bytes | memoryview) -> tuple[int, int]:
    """(stored bytes, objects) of a tenant's totals record."""
    return u64(raw[:8]), u64(raw[8:16])


def meta_record(head: bytes, seqb: bytes, tenant: bytes) -> bytes:
    """The meta record of an object with frame header ``head`` at recency seq ``seqb``, its flags
    saying whether it has a tenant record (an object of a named ``tenant``)."""
    return head + seqb + (_NAMED_FLAGS if tenant else META_FLAGS)


def meta_header(meta: bytes | memoryview) -> bytes | memoryview:
    """The frame header a meta record begins with (a view when ``meta`` is one)."""
    return meta[:HEADER_BYTES]


def meta_seq(meta: bytes | memoryview | None) -> bytes | None:
    """The recency seq of a well-formed meta record; ``None`` when absent or malformed."""
    return None if meta is None or len(meta) != META_BYTES else bytes(meta[HEADER_BYTES:_SEQ_END])


def named_seq(meta: bytes | memoryview) -> bytes | None:
    """The recency seq a meta record names, even a malformed one long enough to name one (deleting
    an object deletes that recency record only if it points back at the object)."""
    return bytes(meta[HEADER_BYTES:_SEQ_END]) if len(meta) >= _SEQ_END else None


def with_seq(meta: bytes, seqb: bytes) -> bytes:
    """A well-formed meta record moved to recency seq ``seqb`` (header and flags unchanged)."""
    return meta[:HEADER_BYTES] + seqb + meta[_SEQ_END:]


def may_have_tenant(meta: bytes | memoryview | None) -> bool:
    """Whether the object whose meta record is ``meta`` may have a tenant record: its flags say so,
    or the record is malformed (then only the tenant record itself can tell)."""
    return meta is not None and (len(meta) != META_BYTES or bool(meta[-1] & TENANT_FLAG))


def stale_recency(meta: Any, seqb: bytes) -> bool:
    """Whether the recency record ``seqb`` of an object whose meta record is ``meta`` is left over
    (the object is gone, or a touch gave it another seq). A malformed meta is not stale: reading or
    evicting it finds the damage."""
    return meta is None or (len(meta) == META_BYTES and bytes(meta[HEADER_BYTES:-1]) != bytes(seqb))


def meta_stored_len(meta: bytes | memoryview) -> int | None:
    """The stored length a meta record's header claims, if the header's own checksum holds.

    For byte accounting on the write path only (cheaper than a full frame header decode); reads
    still verify everything with :meth:`FrameHeader.decode <tiercache.tier.frames.FrameHeader.decode>`.
    """
    if len(meta) != META_BYTES:
        return None
    body = meta[:_HEADER_BODY]
    if xxhash.xxh3_64_intdigest(body) != int.from_bytes(meta[_HEADER_BODY:HEADER_BYTES], "little"):
        return None
    return int.from_bytes(meta[_STORED_LEN_AT : _STORED_LEN_AT + 8], "little")


def scan_records(env: lmdb.Environment, db: Any, *, objects_only: bool) -> Iterator[tuple[bytes, bytes]]:
    """(key, value) pairs of one sub-database in key order, in batches of :data:`ITER_BATCH`, each
    batch in its own short read txn: no txn stays open between yields, so a slow consumer cannot pin
    pages.

    ``objects_only`` stops at the reserved recency/info records of the meta database. Raises
    ``lmdb.Error``; callers translate it.
    """
    start: bytes | None = None
    while True:
        batch: list[tuple[bytes, bytes]] = []
        with env.begin(db=db) as txn, txn.cursor(db=db) as cur:
            found = cur.set_range(start) if start is not None else cur.first()
            while found and len(batch) < ITER_BATCH:
                k = bytes(cur.key())
                if objects_only and k[0] >= FIRST_RESERVED:
                    break  # recency and info records sort after every object key
                if k != start:
                    batch.append((k, bytes(cur.value())))
                found = cur.next()
        if not batch:
            return
        yield from batch
        start = batch[-1][0]


def named_tenant_totals(txn: Any, db: Any) -> dict[bytes, tuple[int, int]]:
    """Bytes and objects of every named tenant, from its ``INFO_TENANT`` record, in ``txn``."""
    out: dict[bytes, tuple[int, int]] = {}
    with txn.cursor(db=db) as cur:
        found = cur.set_range(INFO_TENANT)
        while found:
            k = bytes(cur.key())
            if not k.startswith(INFO_TENANT):
                break
            out[k[len(INFO_TENANT) :]] = unpack_totals(bytes(cur.value()))
            found = cur.next()
    return out


def scan_by_use(env: lmdb.Environment, meta_db: Any) -> Iterator[bytes]:
    """Object keys along the recency records from the young end (most recently used first), in
    batches of :data:`ITER_BATCH` records, each batch in its own short read txn like
    :func:`scan_records`. Records a touch left stale are skipped, so each key comes once. Raises
    ``lmdb.Error``; callers translate it.
    """
    below: bytes | None = None  # continue with the recency records below this one
    while True:
        batch: list[bytes] = []
        with env.begin(db=meta_db) as txn, txn.cursor(db=meta_db) as cur:
            # Recency records sort after every other record of the meta database.
            if below is None:
                found = cur.last()
            else:
                found = cur.prev() if cur.set_range(below) else cur.last()
            scanned = 0
            while found and scanned < ITER_BATCH:
                rkey = bytes(cur.key())
                if not rkey.startswith(REC):
                    found = False
                    break
                below, scanned = rkey, scanned + 1
                kb = bytes(cur.value())
                if not stale_recency(txn.get(kb, db=meta_db), recency_seq(rkey)):
                    batch.append(kb)
                found = cur.prev()
        yield from batch
        if not found:
            return
