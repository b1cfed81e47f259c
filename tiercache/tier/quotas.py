"""Tenant quotas of one tier: how many bytes each tenant may hold before its own objects go first.

A quota is a share of the tier's byte budget: the default share, or the tenant's override. Shares
may add up to more than 1: they order evictions, they reserve nothing (see docs/fleet.md). The
tiers that enforce quotas (L1, disk) decide *whom* to evict with them; this table only says how
much each tenant may hold.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

#: Tenants a tier keeps in-memory counters for (puts, evictions) beyond what they hold; a server with
#: more distinct salts than this stops counting new ones rather than grow without bound.
MAX_COUNTED_TENANTS = 4096


def count_tenant(counter: Counter[bytes], tenant: bytes, n: int = 1) -> None:
    """Add ``n`` to ``tenant``'s count in ``counter``, unless that would make it count more than
    :data:`MAX_COUNTED_TENANTS` tenants."""
    if tenant in counter or len(counter) < MAX_COUNTED_TENANTS:
        counter[tenant] += n


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
