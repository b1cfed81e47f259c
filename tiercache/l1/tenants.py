"""Tenant quotas in L1: bytes per tenant, and who is evicted when the arena needs room.

A tenant is the id of a request's cache salt (:mod:`tiercache.keys.tenant`). Each tenant has a
*quota*: its share of the arena (``--l1-tenant-share``, or its override in ``--l1-tenant-quotas``).
Quotas are soft: free space is used by whoever needs it, and they decide only *who leaves* when a
reservation needs room:

* a requester that would be over its quota evicts its own objects first (in the tier's policy
  order), then objects of other tenants over theirs, and never an object of a tenant under its
  quota: if nothing else may go, its store is refused (counted as skipped);
* a requester within its quota evicts from the tenant furthest over its quota first; only when no
  tenant is over does the tier's one global order choose.

So a flood fills free space, then recycles its own bytes; the others keep theirs. With one tenant,
or every share 1, this is the plain policy.

With quotas on, each tenant has an eviction order of its own (the tier's policy kind), kept beside
the global one; every hook is O(1) amortised, and choosing a victim scans only the tenants over
their quota. Not thread-safe: :class:`~tiercache.l1.tier.L1Tier` calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiercache.config.parts import L1Config
from tiercache.keys.tenant import tenant_label
from tiercache.l1.policy import EvictionPolicy, make_policy
from tiercache.tier.quotas import MAX_COUNTED_TENANTS, TenantQuotas


@dataclass(slots=True)
class TenantUsage:
    """One tenant in one tier: what it holds now and what it lost."""

    bytes: int = 0  # payload bytes of its live slots (reservations and pinned old versions too)
    objects: int = 0  # its committed (visible) objects
    evictions: int = 0  # of its objects, evicted for room
    puts: int = 0  # its objects committed (stores and promotions)


class TenantLedger:
    """Per-tenant usage and quotas of one L1 arena of ``config.size_bytes`` bytes. See the module
    docstring."""

    def __init__(self, config: L1Config) -> None:
        self._quotas = TenantQuotas(config.size_bytes, config.tenant_share, config.tenant_overrides())
        self._policy_name = config.eviction_policy
        #: Whether quotas decide evictions (any share below 1); otherwise usage is only counted.
        self.enforcing = self._quotas.enforcing
        self._usage: dict[bytes, TenantUsage] = {}
        # tenant -> its objects' order, keyed by ObjectKey.raw as the tier's (only while enforcing)
        self._orders: dict[bytes, EvictionPolicy[bytes]] = {}
        self._over: set[bytes] = set()  # tenants holding more than their quota

    def quota(self, tenant: bytes) -> int:
        """Bytes ``tenant`` may hold before its own objects go first."""
        return self._quotas.quota(tenant)

    def usage(self, tenant: bytes) -> TenantUsage:
        """What ``tenant`` holds (a zero record for one never seen)."""
        return self._usage.get(tenant) or TenantUsage()

    # -- bytes (every slot allocated or freed) ----------------------------------------------------
    def charge(self, tenant: bytes, nbytes: int) -> None:
        u = self._usage.get(tenant)
        if u is None:
            u = self._usage[tenant] = TenantUsage()
        u.bytes += nbytes
        if self.enforcing and u.bytes > self.quota(tenant):
            self._over.add(tenant)

    def refund(self, tenant: bytes, nbytes: int) -> None:
        u = self._usage[tenant]
        u.bytes -= nbytes
        if tenant in self._over and u.bytes <= self.quota(tenant):
            self._over.discard(tenant)
        # A tenant with nothing left keeps its counters for ``inspect``, up to a bound.
        if u.bytes == 0 and u.objects == 0 and len(self._usage) > MAX_COUNTED_TENANTS:
            del self._usage[tenant]
            self._orders.pop(tenant, None)

    # -- objects (commit, read, removal) ----------------------------------------------------------
    def on_insert(self, key: bytes, tenant: bytes) -> None:
        u = self._usage[tenant]  # charged at reserve, so the record exists
        u.objects += 1
        u.puts += 1
        if self.enforcing:
            order = self._orders.get(tenant)
            if order is None:
                order = self._orders[tenant] = make_policy(self._policy_name)
            order.on_insert(key)

    def on_access(self, key: bytes, tenant: bytes) -> None:
        if self.enforcing:
            order = self._orders.get(tenant)
            if order is not None:
                order.on_access(key)

    def on_remove(self, key: bytes, tenant: bytes) -> None:
        """``key`` left for a reason other than :meth:`choose_victim` (an overwrite, a delete)."""
        self._usage[tenant].objects -= 1
        if self.enforcing:
            order = self._orders.get(tenant)
            if order is not None:
                order.on_remove(key)

    def evicted(self, tenant: bytes) -> None:
        """An object of ``tenant`` that :meth:`choose_victim` (or the global order) chose is gone."""
        u = self._usage[tenant]
        u.objects -= 1
        u.evictions += 1

    def evicted_many(self, gone: Sequence[tuple[bytes, int]]) -> None:
        """:meth:`evicted` and :meth:`refund` of each ``(tenant, nbytes)`` in ``gone``, in the
        global order's batch (one refund per tenant)."""
        freed: dict[bytes, int] = {}
        usage = self._usage
        for tenant, nbytes in gone:
            u = usage[tenant]
            u.objects -= 1
            u.evictions += 1
            freed[tenant] = freed.get(tenant, 0) + nbytes
        for tenant, nbytes in freed.items():
            self.refund(tenant, nbytes)

    # -- who leaves --------------------------------------------------------------------------------
    def choose_victim(
        self,
        requester: bytes,
        nbytes: int,
        policy: EvictionPolicy[bytes],
        can_evict: Callable[[bytes], bool],
        tenant_of: Callable[[bytes], bytes],
    ) -> bytes | None:
        """The next object to evict so ``requester`` can reserve ``nbytes``, untracked in both the
        global ``policy`` and its tenant's order; ``None`` when nothing may go for this requester."""
        if not self.enforcing:
            return policy.evict_one(can_evict)
        own = self.usage(requester).bytes + nbytes > self.quota(requester)
        if own:
            key = self._evict_from(requester, policy, can_evict)
            if key is not None:
                return key
        # The tenant furthest over its quota pays first.
        for tenant in sorted(self._over, key=self._overage, reverse=True):
            if tenant == requester:
                continue
            key = self._evict_from(tenant, policy, can_evict)
            if key is not None:
                return key
        if own:
            return None  # only tenants within their quota are left: they keep their objects
        key = policy.evict_one(can_evict)
        if key is not None:
            order = self._orders.get(tenant_of(key))
            if order is not None:
                order.on_remove(key)
        return key

    def _overage(self, tenant: bytes) -> int:
        return self._usage[tenant].bytes - self.quota(tenant)

    def _evict_from(
        self, tenant: bytes, policy: EvictionPolicy[bytes], can_evict: Callable[[bytes], bool]
    ) -> bytes | None:
        order = self._orders.get(tenant)
        key = order.evict_one(can_evict) if order is not None else None
        if key is not None:
            policy.on_remove(key)
        return key

    # -- observation -------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, dict[str, int]]:
        """Per tenant (by :func:`~tiercache.keys.tenant.tenant_label`): bytes, objects, quota_bytes,
        evictions, puts."""
        return {
            tenant_label(t): {
                "bytes": u.bytes,
                "objects": u.objects,
                "quota_bytes": self.quota(t),
                "evictions": u.evictions,
                "puts": u.puts,
            }
            for t, u in self._usage.items()
        }

    def clear(self) -> None:
        self._usage.clear()
        self._orders.clear()
        self._over.clear()
