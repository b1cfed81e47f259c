"""Opening the disk tier's LMDB environment, and what the file system under it says.

:func:`open_environment` creates the directory (owner-only when it is ours), opens the environment
with the tier's settings and checks its layout before anything reads it: layout 1 and unknown
versions are refused, an upgradable one (:data:`~tiercache.l2_disk.records.UPGRADABLE_FORMATS`) is
upgraded in place. Every failure is a :class:`~tiercache.errors.DiskTierError` naming the path and
what to check, with the environment closed again.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lmdb

from tiercache.errors import DiskTierError
from tiercache.l2_disk.records import (
    DB_NAMES,
    DISK_FORMAT_VERSION,
    INFO_FORMAT,
    MAX_READERS,
    UPGRADABLE_FORMATS,
    b64,
    u64,
)

log = logging.getLogger(__name__)


def open_environment(path: Path, map_size: int) -> tuple[lmdb.Environment, dict[str, Any]]:
    """The environment at ``path`` and its sub-databases by name (``recency`` and ``info`` name
    ``meta``: their records are prefixed ones in it, see :mod:`tiercache.l2_disk.records`)."""
    _make_directory(path)
    env = _open_lmdb(path, map_size)
    try:
        dbs = _open_dbs(env, path)
    except lmdb.Error as exc:
        env.close()
        raise DiskTierError(
            f"cannot initialise the LMDB environment at {path}: {exc}; check free space and permissions there, "
            "or point --disk-path elsewhere"
        ) from exc
    except DiskTierError:
        env.close()
        raise
    return env, dbs


def _make_directory(path: Path) -> None:
    try:
        if not path.exists():
            # Ours: owner-only. An existing directory keeps its mode (a shared one, 1777, made
            # 0700 would lock its other users out); its LMDB files are created owner-only below.
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(path, 0o700)
    except OSError as exc:
        raise DiskTierError(
            f"cannot create the disk tier directory {path}: {exc}; check the path and its permissions"
        ) from exc


def _open_lmdb(path: Path, map_size: int) -> lmdb.Environment:
    old_umask = os.umask(0o077)  # data.mdb and lock.mdb are created owner-only
    try:
        return lmdb.open(
            str(path),
            map_size=map_size,
            max_dbs=8,
            max_readers=MAX_READERS,
            sync=False,
            metasync=False,
            writemap=False,
            readahead=True,
            meminit=False,
            mode=0o600,
        )
    except lmdb.Error as exc:
        raise DiskTierError(
            f"cannot open the LMDB environment at {path}: {exc}; is it open in another "
            "tiercache server, or on a file system without mmap/locking support?"
        ) from exc
    finally:
        os.umask(old_umask)


def _open_dbs(env: lmdb.Environment, path: Path) -> dict[str, Any]:
    """Check the layout of ``env`` (upgrading an upgradable one) and open its sub-databases."""
    with env.begin() as txn:
        legacy = txn.get(b"recency") is not None  # layout 1 kept a "recency" sub-database
    if legacy:
        raise DiskTierError(
            f"the disk tier at {path} was written by layout version 1, this build reads "
            f"{DISK_FORMAT_VERSION}; delete the directory (it is a cache) or point "
            "--disk-path elsewhere"
        )
    dbs = {name: env.open_db(name.encode()) for name in DB_NAMES}
    dbs["recency"] = dbs["info"] = dbs["meta"]  # prefixed records, see records.REC and records.INFO
    with env.begin(write=True, db=dbs["info"]) as txn:
        found = txn.get(INFO_FORMAT, db=dbs["info"])
        if found is None or u64(found) in UPGRADABLE_FORMATS:
            if found is not None:
                log.info(
                    "disk tier at %s: layout %d upgraded to %d in place (its objects are the "
                    "default tenant's)",
                    path,
                    u64(found),
                    DISK_FORMAT_VERSION,
                )
            txn.put(INFO_FORMAT, b64(DISK_FORMAT_VERSION), db=dbs["info"])
        elif u64(found) != DISK_FORMAT_VERSION:
            raise DiskTierError(
                f"the disk tier at {path} was written by layout version {u64(found)}, "
                f"this build reads {DISK_FORMAT_VERSION}; delete the directory (it is a "
                "cache) or point --disk-path elsewhere"
            )
    return dbs


def free_bytes(path: Path) -> int | None:
    """The file system's free space at ``path`` (``None`` when it does not say)."""
    try:
        fs = os.statvfs(path)
    except OSError:
        return None
    return fs.f_bavail * fs.f_frsize


def file_system_room(path: Path) -> int | None:
    """Bytes the environment's file at ``path`` could grow to: its size now plus the file system's
    free space (``None`` when the file system does not say)."""
    free = free_bytes(path)
    data = path / "data.mdb"
    try:
        held = data.stat().st_blocks * 512 if data.exists() else 0
    except OSError:
        return None
    return None if free is None else held + free


__all__ = ["file_system_room", "free_bytes", "open_environment"]
