"""The state and plumbing every part of :class:`~tiercache.sglang.storage.TierCacheStorage` shares:
its settings and counts, the registered host pools and their group refs, the link to the server
(registering every pool on each (re)connect), the mapped arena, and the one way a call reaches the
server (:meth:`StorageBase._call`: ``None`` when it is away, never an exception). The store, load
and exists paths (:mod:`tiercache.sglang.stores`, :mod:`tiercache.sglang.loads`,
:mod:`tiercache.sglang.exists`) are subclasses of it, joined in ``TierCacheStorage``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, PoolTransfer

from tiercache.client.client import Client
from tiercache.client.link import ServerLink
from tiercache.client.tensors import arena_bytes
from tiercache.errors import ConfigError, ServerError, TierCacheError
from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey
from tiercache.l1.arena import SharedArena
from tiercache.sglang.held import HeldLookups
from tiercache.sglang.keys import KV_GROUP, KV_POOL, POOL_GROUPS, manifest, page_hash
from tiercache.sglang.pools import (
    SUPPORTED_POOLS,
    HostPool,
    UnsupportedPoolError,
    pool_geometry,
    shard_identity,
)
from tiercache.sglang.settings import SGLangSettings
from tiercache.wire import protocol as p

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class StorageCounts:
    """What this backend did since it started (pages unless named otherwise)."""

    stored: int = 0
    store_failed: int = 0
    loaded: int = 0
    load_missed: int = 0
    exists_calls: int = 0
    #: Calls answered without the server (it was away, or the call failed): misses and failed stores.
    unavailable: int = 0
    #: Pages whose copy out of the arena did not match their digest (a miss from there on).
    corrupt: int = 0


class StorageBase(HiCacheStorage):  # type: ignore[misc]  # SGLang is untyped where mypy runs
    """The state, set-up and plumbing of :class:`~tiercache.sglang.storage.TierCacheStorage` (which
    documents the construction); the store, load and exists paths build on it."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        self.settings = SGLangSettings.from_extra_config(storage_config.extra_config)
        self.storage_config = storage_config
        self.shard = shard_identity(storage_config, self.settings)
        self.counts = StorageCounts()
        self._counts_lock = threading.Lock()
        # The registered pools by SGLang name, and their group refs once the server registered them
        # (replaced whole on every (re)connect, so a reader never sees half of a registration).
        self._pools_lock = threading.Lock()
        self._pools: dict[str, HostPool] = {}
        self._refs: dict[str, p.GroupRef] = {}
        self._link: ServerLink | None = None
        # The whole arena as one uint8 tensor, made once per mapping: slicing it per slot costs far
        # less than a frombuffer per slot.
        self._arena: SharedArena | None = None
        self._arena_bytes: torch.Tensor | None = None
        # batch_exists' lookup tickets, kept for the batch_get that follows (tiercache.sglang.held).
        self._held = HeldLookups()

    # -- set-up --------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host KV pool, register this engine's layout with the server (start-up)."""
        super().register_mem_pool_host(mem_pool_host)
        geometry, _ = pool_geometry(mem_pool_host)
        with self._pools_lock:
            self._pools[KV_POOL] = HostPool(KV_POOL, mem_pool_host, KV_GROUP, geometry, True)
        s = self.storage_config
        name = f"sglang-tp{s.tp_rank}-pp{s.pp_rank}"
        self._link = ServerLink(self.settings.link, name, self._on_connect)
        try:
            self._link.start()
        except ConfigError:
            self._link.close()  # this engine does not fit the server: nothing may linger
            raise

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Take one of a hybrid model's host pools (SGLang's hybrid controller registers every pool of
        its ``HostPoolGroup`` this way, the KV pool included, right after ``register_mem_pool_host``).

        The KV pool must be the one registered as the host pool; SWA and Mamba pools get an object
        group and a manifest of their own (registered with the server now, or on connecting). Any
        other pool, or one whose pages this backend cannot read, raises :class:`UnsupportedPoolError`.
        """
        name = str(host_pool_name)
        if name == KV_POOL:
            if host_pool is not getattr(self, "mem_pool_host", None):
                raise UnsupportedPoolError(
                    f"tiercache: SGLang registered a KV pool 'kv' ({type(host_pool).__name__}) that is not the "
                    "host pool it registered first; the tiercache backend stores one KV pool per engine"
                )
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return
        if name not in POOL_GROUPS:
            raise UnsupportedPoolError(
                f"tiercache: SGLang host pool {name!r} ({type(host_pool).__name__}) is not supported by the "
                f"tiercache backend, which stores the pools {', '.join(SUPPORTED_POOLS)}; use another "
                "--hicache-storage-backend (e.g. file) for this model, or run it without one"
            )
        geometry, in_place = pool_geometry(host_pool, name)
        kv = self._pools.get(KV_POOL)
        if in_place and kv is not None and geometry.page_size != kv.geometry.page_size:
            raise UnsupportedPoolError(
                f"tiercache: SGLang host pool {name!r} has pages of {geometry.page_size} tokens but the KV pool "
                f"of {kv.geometry.page_size}; the tiercache backend stores one {name} page per KV page"
            )
        pool = HostPool(name, host_pool, POOL_GROUPS[name], geometry, in_place)
        with self._pools_lock:
            self._pools[name] = pool
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        link = self._link
        client = link.client() if link is not None else None
        if client is None:
            return  # registered with the others on (re)connecting
        try:
            self._register(client, [pool])
        except ConfigError:
            raise
        except TierCacheError as exc:
            assert link is not None
            link.failed(f"registering SGLang pool {name}", exc)  # the reconnect registers it

    def _register(self, client: Client, pools: Sequence[HostPool]) -> None:
        """Register ``pools``' manifests with the server; their refs replace the old ones."""
        chunk = client.server.chunk_size
        groups = [(pool.group, manifest(self.shard, pool.geometry, chunk, pool.name)) for pool in pools]
        refs = client.register(groups)
        with self._pools_lock:
            new = dict(self._refs)
            new.update({pool.name: ref for pool, ref in zip(pools, refs, strict=True)})
            self._refs = new

    def _on_connect(self, client: Client) -> None:
        # A restarted server may have forgotten the manifests: register every pool again. The refs
        # come back the same (a fingerprint is the hash of its manifest), so calls in flight that
        # still hold the old ones name the same objects.
        with self._pools_lock:
            pools = list(self._pools.values())
        self._register(client, pools)

    @property
    def fingerprint(self) -> Fingerprint | None:
        """This engine's KV layout fingerprint (``None`` until the server was first reached)."""
        return self.pool_fingerprint(KV_POOL)

    def pool_fingerprint(self, name: str) -> Fingerprint | None:
        """The layout fingerprint of registered pool ``name`` (``None`` until registered)."""
        ref = self._refs.get(name)
        return None if ref is None else Fingerprint(ref.fingerprint)

    def counters(self) -> dict[str, int]:
        """A snapshot of :class:`StorageCounts` plus the link's outages."""
        with self._counts_lock:
            out = asdict(self.counts)
        out["outages"] = self._link.outages if self._link is not None else 0
        return out

    def close(self) -> None:
        """Disconnect (SGLang calls it when the backend is detached)."""
        self._held.release_all()
        if self._link is not None:
            self._link.close()
        # The tensor over the arena keeps its mapping (and the server's shared memory) alive.
        self._arena = self._arena_bytes = None

    # -- plumbing ------------------------------------------------------------------------------
    def _count(self, **delta: int) -> None:
        with self._counts_lock:
            for name, n in delta.items():
                setattr(self.counts, name, getattr(self.counts, name) + n)

    def _objects(self, name: str, keys: Sequence[str]) -> list[ObjectKey]:
        """The object keys of pool ``name``'s pages ``keys`` (``KeyError`` if not registered)."""
        ref = self._refs[name]
        fp = Fingerprint(ref.fingerprint)
        return ObjectKey.many(fp, ref.object_group, [page_hash(k) for k in keys])

    def _call(self, what: str, fn: Callable[[Client], T]) -> T | None:
        """``fn(client)``, or ``None`` when the server is away or the call failed (then the link
        goes down and reconnects in the background)."""
        link = self._link
        client = link.client() if link is not None else None
        if client is None or KV_POOL not in self._refs:
            return None
        try:
            return fn(client)
        except ServerError as exc:
            if exc.code == "tier_full":  # the server is fine; this store did not fit
                return None
            assert link is not None
            link.failed(what, exc)
        except TierCacheError as exc:
            assert link is not None
            link.failed(what, exc)
        return None

    def _arena_view(self, arena: SharedArena) -> torch.Tensor:
        """``arena`` (a client's mapping of the server's arena) as one uint8 tensor (made again
        only when the mapping changes)."""
        if arena is not self._arena or self._arena_bytes is None:
            self._arena_bytes = arena_bytes(arena)
            self._arena = arena
        return self._arena_bytes

    def _pages(self, host_indices: torch.Tensor, n: int) -> list[torch.Tensor] | None:
        """The KV pool's page views for ``n`` pages at ``host_indices`` (token indices)."""
        kv = self._pools.get(KV_POOL)
        starts = kv.starts(host_indices, n) if kv is not None else None
        return None if kv is None or starts is None else kv.sources(starts)

    def _transfer_pool(self, transfer: PoolTransfer) -> HostPool | None:
        pool = self._pools.get(str(transfer.name))
        if pool is None:
            log.error(
                "tiercache: SGLang pool %s was never registered with this backend; nothing moved",
                transfer.name,
            )
        return pool

    # -- management ----------------------------------------------------------------------------
    def clear(self) -> None:
        """Delete this engine's objects (every registered pool's) from every tier of the server."""
        for name in list(self._refs):
            fp = self.pool_fingerprint(name)
            if fp is not None:
                self._clear(fp)

    def _clear(self, fp: Fingerprint) -> None:
        self._call("clearing SGLang pages", lambda c: c.clear(fp))
