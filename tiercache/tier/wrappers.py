"""Cross-cutting behaviour as tier wrappers, not as flags inside every tier.

:class:`WrapperTier` forwards every call of the contract to an inner tier; subclasses override what
they change (fault injection for tests: :class:`tiercache.testing.faults.FaultInjectingTier`). It
forwards *every* method, defaults included, so a wrapper never hides what the inner tier does better
or in addition (its eviction hand-over, its manifests); a test checks that no method is missed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey
from tiercache.keys.tenant import DEFAULT_TENANT
from tiercache.tier.contract import (
    EvictionListener,
    FrontTier,
    HeldSet,
    ReadHandle,
    Tier,
    TierUsage,
    WriteHandle,
)
from tiercache.tier.stats import TierStats


class WrapperTier(FrontTier):
    """A tier that forwards everything to ``inner``; shares its name, stats and flags.

    It is a :class:`FrontTier` so that it can wrap L1 too; around any other tier ``owed`` must stay
    false and :meth:`settle` has nothing to do.
    """

    def __init__(self, inner: Tier) -> None:
        # No Tier.__init__: the inner tier owns the stats (see the property below).
        self.inner = inner
        self.name = inner.name
        self.remote = inner.remote

    @property
    def stats(self) -> TierStats:
        return self.inner.stats

    @stats.setter
    def stats(self, value: TierStats) -> None:  # Tier.__init__ compatibility; inner owns stats
        pass

    def reserve(self, key: ObjectKey, nbytes: int, *, tenant: bytes = DEFAULT_TENANT) -> WriteHandle:
        if isinstance(self.inner, FrontTier):
            return self.inner.reserve(key, nbytes, tenant=tenant)
        return self.inner.reserve(key, nbytes)  # only a front tier keeps tenant quotas

    def reserve_many(
        self, items: Sequence[tuple[ObjectKey, int]], *, tenants: Sequence[bytes] = ()
    ) -> list[WriteHandle]:
        if isinstance(self.inner, FrontTier):
            return self.inner.reserve_many(items, tenants=tenants)
        return super().reserve_many(items, tenants=tenants)  # one reserve after another, as for any tier

    def commit(self, handle: WriteHandle, *, owed: bool = False, digest: int | None = None) -> None:
        if isinstance(self.inner, FrontTier):
            self.inner.commit(handle, owed=owed, digest=digest)
        elif owed:
            raise TypeError(f"the {self.name} tier is not a front tier: it cannot hold owed objects")
        else:
            self.inner.commit(handle)

    def commit_many(
        self,
        handles: Sequence[WriteHandle],
        *,
        owed: bool = False,
        digests: Sequence[int | None] | None = None,
    ) -> None:
        if isinstance(self.inner, FrontTier):
            self.inner.commit_many(handles, owed=owed, digests=digests)
        else:
            super().commit_many(handles, owed=owed, digests=digests)  # one commit after another

    def settle(self, key: ObjectKey) -> None:
        if isinstance(self.inner, FrontTier):
            self.inner.settle(key)

    def abort(self, handle: WriteHandle) -> None:
        self.inner.abort(handle)

    def contains(self, key: ObjectKey) -> bool:
        return self.inner.contains(key)

    def pin(self, key: ObjectKey, *, count: bool = True) -> ReadHandle | None:
        return self.inner.pin(key, count=count)

    def release(self, handle: ReadHandle) -> None:
        self.inner.release(handle)

    def delete(self, key: ObjectKey) -> bool:
        return self.inner.delete(key)

    def usage(self) -> TierUsage:
        return self.inner.usage()

    def tenants(self) -> dict[str, dict[str, int]]:
        return self.inner.tenants()

    def iter_keys(self) -> Iterator[ObjectKey]:
        return self.inner.iter_keys()

    def iter_keys_by_use(self) -> Iterator[ObjectKey]:
        return self.inner.iter_keys_by_use()

    def put(
        self,
        key: ObjectKey,
        data: bytes | bytearray | memoryview,
        *,
        owed: bool = False,
        tenant: bytes = DEFAULT_TENANT,
        digest: int | None = None,
    ) -> None:
        if isinstance(self.inner, FrontTier):
            self.inner.put(key, data, owed=owed, tenant=tenant, digest=digest)
        elif owed:
            raise TypeError(f"the {self.name} tier is not a front tier: it cannot hold owed objects")
        else:
            self.inner.put(key, data, tenant=tenant, digest=digest)

    def tenant_of(self, key: ObjectKey) -> bytes:
        if isinstance(self.inner, FrontTier):
            return self.inner.tenant_of(key)
        return DEFAULT_TENANT

    def get(self, key: ObjectKey) -> bytes | None:
        return self.inner.get(key)

    def read_into(self, key: ObjectKey, alloc: Callable[[int], memoryview]) -> int | None:
        return self.inner.read_into(key, alloc)

    def recheck(self, key: ObjectKey, offset: int | None = None) -> bool | None:
        return self.inner.recheck(key, offset) if isinstance(self.inner, FrontTier) else None

    def writing_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return (
            self.inner.writing_many(keys) if isinstance(self.inner, FrontTier) else super().writing_many(keys)
        )

    def pin_all(self, raws: Sequence[bytes]) -> HeldSet | None:
        return self.inner.pin_all(raws) if isinstance(self.inner, FrontTier) else None

    def release_all(self, held: HeldSet, *, read: bool = False) -> int:
        return self.inner.release_all(held, read=read) if isinstance(self.inner, FrontTier) else held.count

    def committed_keys(self, raws: Sequence[bytes]) -> list[ObjectKey | None]:
        return (
            self.inner.committed_keys(raws)
            if isinstance(self.inner, FrontTier)
            else super().committed_keys(raws)
        )

    def wait_written(self, keys: Sequence[ObjectKey], timeout: float) -> bool:
        if isinstance(self.inner, FrontTier):
            return self.inner.wait_written(keys, timeout)
        return super().wait_written(keys, timeout)

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return self.inner.contains_many(keys)

    def pin_many(self, keys: Sequence[ObjectKey], *, count: bool = True) -> list[ReadHandle | None]:
        return self.inner.pin_many(keys, count=count)

    def release_many(self, handles: Sequence[ReadHandle], *, read: bool = False) -> list[bool]:
        return self.inner.release_many(handles, read=read)

    def lookup_prefix(self, keys: Sequence[ObjectKey]) -> int:
        return self.inner.lookup_prefix(keys)

    def put_manifest(self, fingerprint: Fingerprint, data: bytes) -> None:
        self.inner.put_manifest(fingerprint, data)

    def get_manifest(self, fingerprint: Fingerprint) -> bytes | None:
        return self.inner.get_manifest(fingerprint)

    def iter_manifests(self) -> Iterator[tuple[Fingerprint, bytes]]:
        return self.inner.iter_manifests()

    def put_state(self, name: str, data: bytes) -> bool:
        return self.inner.put_state(name, data)

    def get_state(self, name: str) -> bytes | None:
        return self.inner.get_state(name)

    def set_eviction_listener(self, listener: EvictionListener | None) -> None:
        self.inner.set_eviction_listener(listener)

    def flush(self, timeout: float | None = None) -> None:
        self.inner.flush(timeout)

    def close(self) -> None:
        self.inner.close()
