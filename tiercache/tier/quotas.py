"""Tenant quotas of one tier: how many bytes each tenant may hold before its own objects go first.

A quota is a share of the tier's byte budget: the default share, or the tenant's override. Shares
may add up to more than 1: they order evictions, they reserve nothing (see docs/fleet.md). The
tiers that enforce quotas (L1, disk) decide *whom* to evict with them; this table only says how
much each tenant may hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TenantQuotas:
    """``share`` of ``budget`` bytes per tenant, or ``overrides[tenant]`` of it."""

    budget: int
    share: float = 1.0
    overrides: Mapping[bytes, float] = field(default_factory=dict)

    @property
    def enforcing(self) -> bool:
        """Whether some tenant's share is below the whole budget (otherwise quotas change nothing)."""
        return self.share < 1 or any(s < 1 for s in self.overrides.values())

    def quota(self, tenant: bytes) -> int:
        """Bytes ``tenant`` may hold before its own objects are the first evicted."""
        return int(self.overrides.get(tenant, self.share) * self.budget)
