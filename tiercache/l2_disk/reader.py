"""A strictly read-only view of a disk tier's LMDB environment, for ``tiercache inspect --disk-path``.

:class:`DiskReader` opens the environment with ``readonly=True`` and ``lock=True``: LMDB refuses every
write transaction, and the reader registers in the shared lock table like any reader, so it is safe
while a live server has the same directory open (the server's writer will not reuse pages this reader
still sees). It never creates the directory or a sub-database, starts no thread, and has no method
that writes. The only file it touches is ``lock.mdb`` (its reader slot, as every LMDB reader does);
``data.mdb`` is never modified.

Every method may block on disk reads; each runs in one short read transaction (iteration in batches,
none held between yields), so an inspector left open cannot pin pages and grow the server's file.
LMDB forbids opening one environment twice in one process: do not use a reader in a process that has
a :class:`~tiercache.l2_disk.DiskTier` open on the same path.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import lmdb

from tiercache.errors import DiskTierError
from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey
from tiercache.l2_disk.records import (
    DB_NAMES,
    DISK_FORMAT_VERSION,
    INFO_FORMAT,
    INFO_USED,
    MAX_READERS,
    UPGRADABLE_FORMATS,
    scan_records,
    u64,
)
from tiercache.tier.contract import TierUsage


class DiskReader:
    """Read-only access to the objects and manifests of the disk tier at ``path``.

    Raises :class:`~tiercache.errors.DiskTierError` naming the path and what to check when there is no
    disk tier there, it cannot be opened, or it was written by another layout version.
    ``bytes_budget`` of :meth:`usage` is 0: the budget is server configuration, not stored on disk.
    """

    name = "disk"

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if not (self.path / "data.mdb").is_file():
            raise DiskTierError(
                f"no disk tier at {self.path} (no data.mdb there); check --disk-path (the server's "
                "--disk-path, default ~/.local/share/tiercache/disk)"
            )
        try:
            self._env = lmdb.open(
                str(self.path),
                readonly=True,
                lock=True,  # take a reader slot: safe beside a live server's writer
                create=False,
                max_dbs=8,
                max_readers=MAX_READERS,
                readahead=False,
            )
        except lmdb.Error as exc:
            raise DiskTierError(
                f"cannot open the disk tier at {self.path} read-only: {exc}; check that this user may "
                "read data.mdb and write lock.mdb"
            ) from exc
        try:
            self._dbs: dict[str, Any] = {
                name: self._env.open_db(name.encode(), create=False) for name in DB_NAMES
            }
            found = self._get("meta", INFO_FORMAT)
        except lmdb.Error as exc:
            self._env.close()
            raise DiskTierError(
                f"{self.path} is not a tiercache disk tier ({exc}); check --disk-path"
            ) from exc
        if u64(found) != DISK_FORMAT_VERSION and u64(found) not in UPGRADABLE_FORMATS:
            self._env.close()
            version = u64(found) if found is not None else "1 or older"
            raise DiskTierError(
                f"the disk tier at {self.path} has layout version {version}, this build reads "
                f"{DISK_FORMAT_VERSION}; inspect it with the matching tiercache version"
            )

    def close(self) -> None:
        """Close the environment (frees the reader slot). Idempotent."""
        self._env.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _get(self, db: str, key: bytes) -> bytes | None:
        with self._env.begin(db=self._dbs[db]) as txn:
            return txn.get(key)

    def usage(self) -> TierUsage:
        """Stored bytes and object count as the tier persisted them (budget unknown: 0)."""
        try:
            with self._env.begin() as txn:
                used = u64(txn.get(INFO_USED, db=self._dbs["meta"]))
                objects = txn.stat(self._dbs["data"])["entries"]
        except lmdb.Error as exc:
            raise DiskTierError(f"cannot read the disk tier at {self.path}: {exc}") from exc
        return TierUsage(used, 0, objects)

    def _scan(self, db_name: str) -> Iterator[tuple[bytes, bytes]]:
        try:
            yield from scan_records(self._env, self._dbs[db_name], objects_only=db_name == "meta")
        except lmdb.Error as exc:
            raise DiskTierError(f"cannot read the disk tier at {self.path}: {exc}") from exc

    def iter_keys(self) -> Iterator[ObjectKey]:
        """Every committed key, in key order (records that are not keys are skipped)."""
        for kb, _meta in self._scan("meta"):
            try:
                yield ObjectKey.from_bytes(kb)
            except ValueError:
                continue

    def contains(self, key: ObjectKey) -> bool:
        """Whether ``key`` is committed (presence only; the payload is not verified)."""
        try:
            return self._get("meta", key.to_bytes()) is not None
        except lmdb.Error as exc:
            raise DiskTierError(f"cannot read the disk tier at {self.path}: {exc}") from exc

    def get_manifest(self, fingerprint: Fingerprint) -> bytes | None:
        """The stored manifest JSON of ``fingerprint``, or ``None``."""
        try:
            return self._get("manifests", fingerprint.raw)
        except lmdb.Error as exc:
            raise DiskTierError(f"cannot read the disk tier at {self.path}: {exc}") from exc

    def iter_manifests(self) -> Iterator[tuple[Fingerprint, bytes]]:
        """Every stored ``(fingerprint, manifest JSON)``, in fingerprint order."""
        for raw, data in self._scan("manifests"):
            yield Fingerprint(raw), data

    def __repr__(self) -> str:
        return f"DiskReader(path={str(self.path)!r})"


__all__ = ["DiskReader"]
