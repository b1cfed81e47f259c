"""L2: the disk tier, one LMDB environment on local NVMe.

Warm chunks live here between the L1 arena and S3. Every object is a self-verifying frame (header in
the ``meta`` sub-database, stored payload in ``data``), so a flipped bit or a foreign record is a
counted miss plus a deletion, never a hit. Objects and their LRU order survive restarts; the LMDB
map is sized with headroom and eviction runs ahead of it, so ``MDB_MAP_FULL`` is handled, not fatal.

Importing this package imports ``lmdb``; ``import tiercache`` alone does not.
"""

from tiercache.l2_disk.tier import DISK_FORMAT_VERSION, DiskTier

__all__ = ["DISK_FORMAT_VERSION", "DiskTier"]
