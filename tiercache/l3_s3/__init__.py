"""L3: the S3 tier — cold chunks in S3 or any S3-compatible store, shared by every node.

See :class:`S3Tier` and ``docs/s3.md``.
"""

from tiercache.l3_s3.breaker import BreakerState, CircuitBreaker
from tiercache.l3_s3.tier import S3Tier

__all__ = ["BreakerState", "CircuitBreaker", "S3Tier"]
