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

Shared by the tier (:mod:`tiercache.l2_disk.tier`), which writes this format, and the read-only
reader (:mod:`tiercache.l2_disk.reader`) of ``tiercache inspect``.
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


def u64(raw: bytes | memoryview | None) -> int:
    """A big-endian u64 record value (0 when absent)."""
    return 0 if raw is None else int.from_bytes(raw, "big")


def b64(value: int) -> bytes:
    """``value`` as a big-endian u64 record value or key part."""
    return value.to_bytes(8, "big")


def recency_key(seqb: bytes) -> bytes:
    """The recency record's key for a sequence number (u64 BE)."""
    return REC + seqb


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


def tenant_totals(txn: Any, db: Any) -> dict[bytes, tuple[int, int]]:
    """Bytes and objects of every named tenant, from its ``INFO_TENANT`` record, in ``txn``."""
    out: dict[bytes, tuple[int, int]] = {}
    with txn.cursor(db=db) as cur:
        found = cur.set_range(INFO_TENANT)
        while found:
            k = bytes(cur.key())
            if not k.startswith(INFO_TENANT):
                break
            v = bytes(cur.value())
            out[k[len(INFO_TENANT) :]] = (u64(v[:8]), u64(v[8:16]))
            found = cur.next()
    return out
