"""The tier contract and what every tier shares: handles, usage, counters, frames, staging, wrappers.

The contract (:mod:`tiercache.tier.contract`) is all the engine knows of a tier; L1, L2 and L3
implement it in their own packages, and :mod:`tiercache.testing.tier_suite` checks it.
"""

from tiercache.tier.contract import (
    EvictionListener,
    FrontTier,
    HeldSet,
    ReadHandle,
    Tier,
    TierUsage,
    WriteHandle,
)
from tiercache.tier.stats import TRANSFER_OPS, Counters, EvictionReason, TierStats

__all__ = [
    "TRANSFER_OPS",
    "Counters",
    "EvictionListener",
    "EvictionReason",
    "FrontTier",
    "HeldSet",
    "ReadHandle",
    "Tier",
    "TierStats",
    "TierUsage",
    "WriteHandle",
]
