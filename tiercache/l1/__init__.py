"""L1: the shared host-memory arena, its allocator and eviction policies, and the copy back-ends.

Importing this package never imports torch; :class:`CudaCopyBackend` imports it when constructed.
"""

from tiercache.l1.allocator import Extent, SlotAllocator
from tiercache.l1.arena import ArenaSlot, SharedArena, default_arena_name
from tiercache.l1.copy import (
    CopyBackend,
    CopyJob,
    CopyResult,
    CpuCopyBackend,
    CudaCopyBackend,
)
from tiercache.l1.policy import EvictionPolicy, LRUPolicy, S3FIFOPolicy, make_policy
from tiercache.l1.tier import L1Tier

__all__ = [
    "ArenaSlot",
    "CopyBackend",
    "CopyJob",
    "CopyResult",
    "CpuCopyBackend",
    "CudaCopyBackend",
    "EvictionPolicy",
    "Extent",
    "L1Tier",
    "LRUPolicy",
    "S3FIFOPolicy",
    "SharedArena",
    "SlotAllocator",
    "default_arena_name",
    "make_policy",
]
