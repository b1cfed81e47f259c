"""Build the tiers and the engine a :class:`~tiercache.config.ServerConfig` describes."""

from __future__ import annotations

import tempfile
from pathlib import Path

from tiercache.config.server import ServerConfig
from tiercache.engine import TieredEngine
from tiercache.errors import DiskTierError
from tiercache.l1.tier import L1Tier
from tiercache.tier.contract import Tier


def build_engine(config: ServerConfig) -> TieredEngine:
    """Create the tiers and the engine; the caller owns (and must close) the engine.

    Checks start-up conditions with one-line errors: ``/dev/shm`` too small
    (:class:`~tiercache.errors.ArenaError`), disk directory not writable
    (:class:`~tiercache.errors.DiskTierError`), bucket unreachable
    (:class:`~tiercache.errors.S3TierError`). Tiers created before a failure are closed again.
    """
    l1 = L1Tier(config.l1)
    lower: list[Tier] = []
    try:
        if config.disk is not None:
            from tiercache.l2_disk import (
                DiskTier,  # lmdb: imported only when the tier runs
            )

            _check_writable(config.disk.path)
            lower.append(DiskTier(config.disk))
        if config.s3 is not None:
            from tiercache.l3_s3 import (
                S3Tier,  # boto3: imported only when the tier runs
            )

            lower.append(S3Tier(config.s3))
        return TieredEngine(l1, lower, config.engine)
    except BaseException:
        for tier in reversed([l1, *lower]):
            tier.close()
        raise


def _check_writable(path: Path) -> None:
    """Create ``path`` (owner-only) and prove a file can be written in it.

    A probe rather than ``os.access``: root passes every permission check, but not a read-only mount.
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise DiskTierError(
            f"the disk tier directory {path} is not writable ({exc.strerror or exc}); fix its "
            "permissions or choose another --disk-path"
        ) from None
