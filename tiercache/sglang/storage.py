"""``TierCacheStorage``: an SGLang ``HiCacheStorage`` whose pages live in a tiercache server.

SGLang's cache controller calls a storage backend from its prefetch and backup threads with page
keys and host-pool indices. This backend maps each page key to a tiercache object key
(:mod:`tiercache.sglang.keys`) and moves page bytes between SGLang's host KV pool and the server's
L1 arena, which it maps like the vLLM connector does, in one copy each way:

* **store** (``batch_set_v1``): reserve every page's slot in one round trip, copy each page view of
  the host pool straight into its slot, commit in a second round trip;
* **load** (``batch_get_v1``): pin the pages in L1 (one round trip on the server's request loop);
  if any is not there, one lookup instead, which pins the leading run of hits after promoting them
  from disk or S3; copy each slot straight into its page of the host pool, release;
* **exists** (``batch_exists``): one lookup without pinning; its ``chunks`` is the number of
  leading hits, which is what SGLang asks for.

A hybrid model's extra pools (SWA, Mamba; SGLang's ``register_mem_host_pool_v2``) each get an object
group and a manifest of their own, so their pages never match a KV page or another layout's. The v2
calls move them: ``batch_set_v2`` stores every transfer's pages in one reserve and one commit,
``batch_get_v2`` loads them under one pin and one release (a pool not wholly in L1: one lookup of
its own), ``batch_exists_v2`` applies SGLang's hit policies (``ALL_PAGES``, ``TRAILING_PAGES``) to
per-pool lookups. A pool whose pages are views of one tensor (KV, SWA) is copied in place; one that
is not (Mamba: several state tensors per slot) goes through SGLang's own flat-page calls. Pools this
backend cannot store are refused when SGLang registers them (:class:`UnsupportedPoolError`).

Every object the server hands back was verified by it (checksums on L2/L3), and its key carries this
engine's fingerprint, so a foreign or damaged object is a miss, never a page. While the server is
away the backend answers misses and failed stores at once and reconnects in the background (the
connector's :class:`~tiercache.client.link.ServerLink`): SGLang keeps serving and recomputes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeAlias, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from tiercache.client.client import Client
from tiercache.client.link import ServerLink
from tiercache.client.tensors import arena_bytes, feed
from tiercache.client.transfer import Load, Store
from tiercache.errors import ConfigError, ServerError, TierCacheError
from tiercache.keys.digest import Digest
from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey
from tiercache.keys.weights import weights_identity
from tiercache.l1.arena import SharedArena
from tiercache.sglang.held import HeldLookup, HeldLookups
from tiercache.sglang.keys import (
    KV_GROUP,
    KV_POOL,
    POOL_GROUPS,
    PageGeometry,
    ShardIdentity,
    manifest,
    page_hash,
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


def _shard(config: HiCacheStorageConfig, settings: SGLangSettings) -> ShardIdentity:
    model = config.model_name or "unknown"
    return ShardIdentity(
        model=model,
        weights=weights_identity(model, None, settings.link.weights_id),
        tp_rank=config.tp_rank,
        tp_size=config.tp_size,
        pp_rank=config.pp_rank,
        pp_size=config.pp_size,
        cp_rank=config.attn_cp_rank,
        cp_size=config.attn_cp_size,
        dcp_rank=config.dcp_rank,
        dcp_size=config.dcp_size,
        is_mla=bool(config.is_mla_model),
        split_heads=bool(config.should_split_heads),
        tp_lcm_size=config.tp_lcm_size,
        page_first=bool(config.is_page_first_layout),
    )


class UnsupportedPoolError(ConfigError):
    """An SGLang host pool this backend cannot store; raised when SGLang registers it, so SGLang's
    start fails saying so instead of storing the pool wrong."""


#: The SGLang pools this backend stores (``PoolName`` values); any other is refused at start-up.
SUPPORTED_POOLS = tuple(POOL_GROUPS)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _view_page(pool: Any) -> Any:
    """Page 0 of ``pool`` as a view of the pool's own ``kv_buffer``, or ``None`` when the pool has
    no such buffer or its pages are not views of it."""
    buffer = getattr(pool, "kv_buffer", None)
    page: Any = None
    if isinstance(buffer, torch.Tensor):
        page = pool.get_data_page(0, flat=False)
        # The zero-copy path writes loaded pages through this view: it must be the pool's own memory.
        if page.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
            page = None
    return page


def _state_layouts(pool: Any) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
    """The shapes and dtypes of a multi-state page's states (Mamba: temporal, then each conv), as
    the pool names them; empty for a pool that names none."""
    # They are part of what the bytes mean, so they go into the fingerprint.
    shapes: list[tuple[int, ...]] = []
    dtypes: list[str] = []
    temporal = getattr(pool, "temporal_state_shape", None)
    if temporal is not None:
        shapes.append(tuple(int(d) for d in temporal))
        dtypes.append(_dtype_name(getattr(pool, "temporal_dtype", "")))
    for conv in getattr(pool, "conv_state_shapes", None) or ():
        shapes.append(tuple(int(d) for d in conv))
        dtypes.append(_dtype_name(getattr(pool, "conv_dtype", "")))
    return tuple(shapes), tuple(dtypes)


def _flat_geometry(pool: Any, name: str, kind: str) -> PageGeometry:
    """The geometry of an extra pool copied through SGLang's flat-page calls (a multi-state page,
    Mamba), or an :class:`UnsupportedPoolError` when the pool has no such calls."""
    flat_calls = all(callable(getattr(pool, f, None)) for f in ("get_data_page", "set_from_flat_data_page"))
    flat = pool.get_data_page(0, flat=True) if flat_calls else None
    if not isinstance(flat, torch.Tensor):
        raise UnsupportedPoolError(
            f"tiercache: SGLang host pool {name!r} ({kind}) has neither page views of one tensor nor "
            "SGLang's flat-page calls (get_data_page / set_from_flat_data_page); the tiercache backend "
            "cannot store it. Use another --hicache-storage-backend for this model"
        )
    shapes, dtypes = _state_layouts(pool)
    layers: Any = getattr(pool, "num_mamba_layers", None) or getattr(pool, "layer_num", 0)
    return PageGeometry(
        pool_class=kind,
        layout=str(pool.layout),
        dtype=_dtype_name(flat.dtype),
        page_size=int(pool.page_size),
        num_layers=int(layers),
        page_shape=(flat.numel(),),
        page_bytes=flat.numel() * flat.element_size(),
        state_shapes=shapes,
        state_dtypes=dtypes,
    )


def _geometry(pool: Any, name: str = KV_POOL) -> tuple[PageGeometry, bool]:
    """A host pool's page geometry, and whether its pages are views of its own buffer (copied in
    place) rather than flat copies (SGLang's ``get_data_page`` / ``set_from_flat_data_page``).

    The KV pool must be in place (the zero-copy calls write loaded pages through the views); an extra
    pool may be either. Anything else is an :class:`UnsupportedPoolError`.
    """
    kind = type(pool).__name__
    page = _view_page(pool)
    if page is not None:
        return (
            PageGeometry(
                pool_class=kind,
                layout=str(pool.layout),
                dtype=_dtype_name(pool.dtype),
                page_size=int(pool.page_size),
                num_layers=int(getattr(pool, "layer_num", 0)),
                page_shape=tuple(int(d) for d in page.shape),
                page_bytes=page.numel() * page.element_size(),
            ),
            True,
        )
    if name == KV_POOL:
        raise UnsupportedPoolError(
            f"tiercache: SGLang host pool {kind} (layout {getattr(pool, 'layout', '?')}) does not keep its KV "
            "pages as views of one tensor, so pages could not be loaded in place; this pool kind is not "
            "supported by the tiercache backend (use an MHA or MLA model, layer_first or page_first)"
        )
    return _flat_geometry(pool, name, kind), False


@dataclass(frozen=True, slots=True)
class _FlatPage:
    """A page of a pool that is not kept as one view (Mamba): loaded with SGLang's own
    ``set_from_flat_data_page``, straight from the arena slot (one copy per state)."""

    host: Any
    index: int
    nbytes: int

    def write(self, src: torch.Tensor) -> None:
        self.host.set_from_flat_data_page(self.index, src)


#: Where a loaded page goes: a view of the host pool, or a flat page written by the pool itself.
Sink: TypeAlias = "torch.Tensor | _FlatPage"


@dataclass(frozen=True, slots=True)
class _Pool:
    """One registered SGLang host pool: its object group, page geometry and how pages move."""

    name: str
    host: Any
    group: int
    geometry: PageGeometry
    in_place: bool

    def starts(self, host_indices: torch.Tensor, n: int) -> list[int] | None:
        """The first host index of each of ``n`` pages at ``host_indices`` (``page_size`` per page),
        or ``None`` (logged) when SGLang passed another number of indices."""
        size = self.geometry.page_size
        if host_indices.numel() != n * size:
            log.error(
                "tiercache: SGLang passed %d host indices for %d pages of %d slots of pool %s; nothing moved",
                host_indices.numel(),
                n,
                size,
                self.name,
            )
            return None
        starts: list[int] = host_indices[::size].tolist()
        return starts

    def sources(self, starts: Sequence[int]) -> list[torch.Tensor]:
        """What to store for pages ``starts``: views of the pool, or flat copies of its pages."""
        get = self.host.get_data_page
        if self.in_place:
            return [get(i, flat=False) for i in starts]
        return [get(i, flat=True) for i in starts]

    def sinks(self, starts: Sequence[int]) -> list[Sink]:
        """Where to load pages ``starts``."""
        if self.in_place:
            get = self.host.get_data_page
            return [get(i, flat=False) for i in starts]
        return [_FlatPage(self.host, i, self.geometry.page_bytes) for i in starts]


class TierCacheStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang is untyped where mypy runs
    """SGLang HiCache storage backed by a tiercache server (see the module docstring).

    SGLang's dynamic factory builds it as ``TierCacheStorage(storage_config, kwargs)``; the settings
    come from ``storage_config.extra_config`` (:mod:`tiercache.sglang.settings`) and a bad value fails
    the construction with :class:`ConfigError`. The server is reached when SGLang registers its host
    pool: a server that is not there yet is retried in the background (misses meanwhile); one that
    does not fit this engine (chunk size) fails the start-up. A hybrid model's extra pools (SWA,
    Mamba) come through ``register_mem_host_pool_v2``; one this backend cannot store fails the start
    with :class:`UnsupportedPoolError`.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        self.settings = SGLangSettings.from_extra_config(storage_config.extra_config)
        self.storage_config = storage_config
        self.shard = _shard(storage_config, self.settings)
        self.counts = StorageCounts()
        self._counts_lock = threading.Lock()
        # The registered pools by SGLang name, and their group refs once the server registered them
        # (replaced whole on every (re)connect, so a reader never sees half of a registration).
        self._pools_lock = threading.Lock()
        self._pools: dict[str, _Pool] = {}
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
        geometry, _ = _geometry(mem_pool_host)
        with self._pools_lock:
            self._pools[KV_POOL] = _Pool(KV_POOL, mem_pool_host, KV_GROUP, geometry, True)
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
        geometry, in_place = _geometry(host_pool, name)
        kv = self._pools.get(KV_POOL)
        if in_place and kv is not None and geometry.page_size != kv.geometry.page_size:
            raise UnsupportedPoolError(
                f"tiercache: SGLang host pool {name!r} has pages of {geometry.page_size} tokens but the KV pool "
                f"of {kv.geometry.page_size}; the tiercache backend stores one {name} page per KV page"
            )
        pool = _Pool(name, host_pool, POOL_GROUPS[name], geometry, in_place)
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

    def _register(self, client: Client, pools: Sequence[_Pool]) -> None:
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

    def _store(self, items: Sequence[tuple[ObjectKey, torch.Tensor]]) -> bool | None:
        """Store each ``(object, page)``: all or none (one reserve, the copies, one commit); whether
        all were stored, or ``None`` when the server was away."""

        def store(client: Client) -> int:
            store = Store.reserve(client, [(o, t.numel() * t.element_size()) for o, t in items])
            arena = self._arena_view(store.arena)

            def write(i: int, target: memoryview) -> int:
                slot, page = store.slot(i), items[i][1]
                arena[slot.offset : slot.offset + slot.nbytes].view(page.dtype).view(page.shape).copy_(page)
                digest = Digest()
                feed(digest, page)  # the host pool's page, never the slot
                return digest.value

            digests = store.fill(write)
            return 0 if digests is None else store.commit(digests)

        done = self._call("storing SGLang pages", store) if items else 0
        if done is None:
            self._count(unavailable=1)
            return None
        return done == len(items)

    def _store_pages(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Store KV ``pages`` under ``keys`` (counted); one verdict for all."""
        ok = False
        if KV_POOL in self._refs:
            ok = bool(self._store(list(zip(self._objects(KV_POOL, keys), pages))))
        else:
            self._count(unavailable=1)  # the server was never reached
        self._count(stored=len(keys) if ok else 0, store_failed=0 if ok else len(keys))
        return [ok] * len(keys)

    def _load(self, parts: Sequence[tuple[str, list[ObjectKey], Sequence[Sink]]]) -> list[int] | None:
        """Load each part ``(pool, objects, sinks)``; how many of each part's leading pages were
        loaded, or ``None`` when the server was away.

        One pin for every part's objects (the common case: all in L1, answered on the server's
        request loop), the copies, one release that says which leases expired during the copy. A part
        not wholly in L1 then gets one lookup of its own, which pins its leading run of hits after
        promoting them from disk or S3.
        """

        def load(client: Client) -> list[int]:
            everything = [o for _, objects, _ in parts for o in objects]
            transfer = Load.pin(client, everything)
            loaded = [0] * len(parts)
            whole: list[int] = []  # the parts wholly in L1, copied under the pin
            at = 0
            cuts: list[int] = []  # where each part's slots start
            for n, (_, objects, _) in enumerate(parts):
                cuts.append(at)
                if all(s is not None for s in transfer.slots[at : at + len(objects)]):
                    whole.append(n)
                at += len(objects)
            corrupt: list[int] = []
            try:
                for n in whole:
                    loaded[n], bad = self._copy_in(transfer, cuts[n], parts[n][2])
                    corrupt += bad
            finally:
                # Reports the corrupt copies; a copy done well inside its leases needs no reply.
                lost = transfer.finish(corrupt)
            for n in whole:
                # A slot whose lease expired may have been reused: a miss from there on.
                loaded[n] = next((i for i in range(loaded[n]) if cuts[n] + i in lost), loaded[n])
            for n, (name, objects, sinks) in enumerate(parts):
                if n not in whole:
                    loaded[n] = self._load_looked_up(client, self._refs[name], objects, sinks)
            return loaded

        return self._call("loading SGLang pages", load) if parts else []

    def _load_looked_up(
        self, client: Client, ref: p.GroupRef, objects: Sequence[ObjectKey], sinks: Sequence[Sink]
    ) -> int:
        """A lookup pins the leading run of hits of one pool (promoting them from disk/S3), the
        copies, the ticket's release; how many were copied."""
        sent_at = client.clock()
        found = client.lookup([o.prefix_hash for o in objects], [ref], max_chunks=len(objects))
        if not found.chunks or not found.ticket:
            return 0
        try:
            if found.pending:
                found = client.wait_ticket(found.ticket, timeout=self.settings.link.timeout_s)
            return self._copy_ticket(client, found, objects, sinks, sent_at) or 0
        finally:
            client.release_ticket(found.ticket)

    def _copy_ticket(
        self,
        client: Client,
        reply: p.LookupReply,
        objects: Sequence[ObjectKey],
        sinks: Sequence[Sink],
        sent_at: float,
    ) -> int | None:
        """Copy the leading ``objects`` from the slots a lookup (sent at ``sent_at``) had its ticket
        pin, each copy checked; how many leading pages were copied and checked (0 when the copy may
        have outlived the ticket's leases), or ``None`` when the ticket is not READY, its slots are
        in another arena than the one mapped (a restarted server's: the offsets mean nothing there),
        or a copy could no longer start in the leases' window."""
        if reply.state is not p.TicketStateName.READY:
            return None
        by_key = {s.key: s for s in reply.slots}
        ready = [by_key.get(o.to_bytes()) for o in objects[: reply.ready_chunks]]
        transfer = Load.adopt(client, client.arena(), reply.arena, ready, sent_at)
        if transfer is None:
            return None
        copied, corrupt = self._copy_in(transfer, 0, sinks)
        lost = transfer.finish(corrupt)
        return 0 if lost else copied  # a lease may have ended during the copy: another object by now

    def _load_held(
        self, client: Client, held: HeldLookup, objects: Sequence[ObjectKey], sinks: Sequence[Sink]
    ) -> int | None:
        """Copy ``objects`` from the slots of ``held``, the ticket of the ``batch_exists`` that asked
        for them (no pin of our own); how many leading pages were copied, 0 when the copy may have
        outlived the ticket's leases, or ``None`` when the ticket cannot be used (another connection
        or arena, too old, its promotion failed): then the caller pins. Releases the ticket."""
        if client is not held.client or not held.usable():
            held.release()
            return None
        reply = held.reply
        if reply.pending:
            reply = client.wait_ticket(reply.ticket, timeout=self.settings.link.timeout_s)
        copied = self._copy_ticket(client, reply, objects, sinks, held.sent_at)
        held.release(read=bool(copied))
        return copied

    def _load_pages(self, keys: Sequence[str], pages: Sequence[Sink]) -> list[bool]:
        """Load KV ``keys`` into ``pages`` (counted); the leading run of hits is ``True``. Pages a
        ``batch_exists`` asked about just before come from its ticket's slots, others are pinned."""
        got = None
        self._held.sweep()
        if KV_POOL in self._refs:
            objects = self._objects(KV_POOL, keys)
            held = self._held.take([o.prefix_hash for o in objects])
            copied = None
            if held is not None:
                copied = self._call(
                    "loading SGLang pages", lambda c: self._load_held(c, held, objects, pages)
                )
            got = [copied] if copied is not None else self._load([(KV_POOL, objects, pages)])
        if got is None:
            self._count(unavailable=1)
        loaded = got[0] if got else 0
        self._count(loaded=loaded, load_missed=len(keys) - loaded)
        return [i < loaded for i in range(len(keys))]

    def _copy_in(self, transfer: Load, first: int, pages: Sequence[Sink]) -> tuple[int, list[int]]:
        """Copy the slots of ``transfer`` from ``first`` on into ``pages``, in order, each copy
        checked against its digest, up to the first that is missing, of another size or fails its
        check. How many were copied, and the slots whose check failed (to report)."""
        arena = self._arena_view(transfer.arena)
        slots = transfer.slots[first : first + len(pages)]
        for i, (slot, page) in enumerate(zip(slots, pages)):
            if slot is None:
                return i, []
            src = arena[slot.offset : slot.offset + slot.nbytes]
            if isinstance(page, _FlatPage):
                if slot.nbytes != page.nbytes:
                    return i, []
                check = transfer.check(first + i)
                page.write(src)
            else:
                if slot.nbytes != page.numel() * page.element_size():
                    return i, []
                check = transfer.check(first + i)
                page.copy_(src.view(page.dtype).view(page.shape))
            check.copied(0, slot.nbytes)  # the slot was just read: still in cache
            if not check.ok():
                self._count(corrupt=1)
                return i, [first + i]
        return min(len(slots), len(pages)), []

    # -- SGLang's zero-copy interface ------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, the server holds (any tier); one round trip. Its
        lookup pins those pages (promoting any from disk or S3) and the ticket is kept for the
        ``batch_get_v1`` SGLang sends next for them (:mod:`tiercache.sglang.held`)."""
        self._count(exists_calls=1)
        self._held.sweep()

        def exists(client: Client) -> int:
            hashes = [page_hash(k) for k in keys]
            hold = client.lease_window_s > 0  # a server that says no lease TTL: nothing to time a copy by
            sent_at = client.clock()
            found = client.lookup(hashes, [self._refs[KV_POOL]], prefetch=hold)
            if found.ticket and found.chunks:
                page_bytes = self._pools[KV_POOL].geometry.page_bytes
                held = HeldLookup.of(client, hashes, page_bytes, found, sent_at)
                self._held.keep(held, client.arena().size)
            elif found.ticket:
                client.release_ticket_unconfirmed(found.ticket)
            return found.chunks

        hits = self._call("asking which SGLang pages exist", exists) if keys else 0
        if hits is None:
            self._count(unavailable=1)
            return 0
        return hits

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store the pages at ``host_indices`` of the host pool under ``keys``: all or none."""
        pages = self._pages(host_indices, len(keys))
        if pages is None:
            self._count(store_failed=len(keys))
            return [False] * len(keys)
        return self._store_pages(keys, pages)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Load ``keys`` into the host pool's pages at ``host_indices``; the leading run of hits is
        ``True``, everything from the first miss ``False``."""
        pages = self._pages(host_indices, len(keys))
        if pages is None:
            self._count(load_missed=len(keys))
            return [False] * len(keys)
        return self._load_pages(keys, pages)

    # -- SGLang's hybrid-pool (v2) interface -------------------------------------------------------
    def _transfer_pool(self, transfer: PoolTransfer) -> _Pool | None:
        pool = self._pools.get(str(transfer.name))
        if pool is None:
            log.error(
                "tiercache: SGLang pool %s was never registered with this backend; nothing moved",
                transfer.name,
            )
        return pool

    def batch_set_v2(self, transfers: list[PoolTransfer], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Store each transfer's pages (its pool's pages at ``host_indices`` under ``keys``), every
        pool's in one reserve and one commit: all or none, reported per pool as SGLang asks."""
        results: dict[Any, list[bool]] = {}
        items: list[tuple[ObjectKey, torch.Tensor]] = []
        moving: list[PoolTransfer] = []
        for transfer in transfers:
            keys = list(transfer.keys or [])
            pool = self._transfer_pool(transfer)
            host = transfer.host_indices
            starts = pool.starts(host, len(keys)) if pool is not None and host is not None else None
            if pool is None or starts is None or pool.name not in self._refs:
                results[transfer.name] = [False] * len(keys)
                continue
            items += zip(self._objects(pool.name, keys), pool.sources(starts))
            moving.append(transfer)
        ok = bool(self._store(items)) if items else not moving
        pages = sum(len(t.keys or []) for t in moving)
        self._count(stored=pages if ok else 0, store_failed=0 if ok else pages)
        for transfer in moving:
            results[transfer.name] = [ok] * len(transfer.keys or [])
        return results

    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Load each transfer's pages into its pool at ``host_indices``; per pool, the leading run
        of hits is ``True`` (SGLang counts each pool's leading run)."""
        results: dict[Any, list[bool]] = {}
        parts: list[tuple[str, list[ObjectKey], Sequence[Sink]]] = []
        moving: list[PoolTransfer] = []
        for transfer in transfers:
            keys = list(transfer.keys or [])
            pool = self._transfer_pool(transfer)
            host = transfer.host_indices
            starts = pool.starts(host, len(keys)) if pool is not None and host is not None else None
            if pool is None or starts is None or pool.name not in self._refs or not keys:
                results[transfer.name] = [False] * len(keys)
                continue
            parts.append((pool.name, self._objects(pool.name, keys), pool.sinks(starts)))
            moving.append(transfer)
        got = self._load(parts) if parts else []
        if got is None:
            self._count(unavailable=1)
            got = [0] * len(parts)
        for transfer, loaded in zip(moving, got, strict=True):
            n = len(transfer.keys or [])
            self._count(loaded=loaded, load_missed=n - loaded)
            results[transfer.name] = [i < loaded for i in range(n)]
        return results

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None, extra_info: Any = None
    ) -> PoolTransferResult:
        """The usable prefix of ``keys`` over the KV pool and each transfer's pool, by the rules of
        SGLang's own ``HiCacheFile.batch_exists_v2`` (sglang 0.5.23):

        * the KV pool's leading run of hits, ``kv``; every prefix ``1..kv`` is a candidate;
        * ``ALL_PAGES``: a prefix ``n`` needs the pool's pages ``0..n-1`` (one lookup: its leading run);
        * ``TRAILING_PAGES`` (``w = len(transfer.keys)``, at least 1): a prefix ``n`` needs only the
          pool's pages ``n-w .. n-1`` (one single-page lookup per page below ``kv``, all in flight at
          once);

        ``kv_hit_pages`` is the longest prefix every pool allows, ``restorable_prefix_pages`` all of
        them (SGLang intersects them across TP ranks), ``extra_pool_hit_pages`` each pool's own
        longest. Any other hit policy raises :class:`UnsupportedPoolError`.
        """
        self._count(exists_calls=1)
        transfers = list(pool_transfers or [])
        for transfer in transfers:
            if transfer.hit_policy not in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES):
                raise UnsupportedPoolError(
                    f"tiercache: SGLang asked for pool {transfer.name} with hit policy {transfer.hit_policy}; "
                    "the tiercache backend applies all_pages and trailing_pages only"
                )

        def exists(client: Client) -> PoolTransferResult:
            hashes = [page_hash(k) for k in keys]
            refs = self._refs
            kv_pages = client.lookup(hashes, [refs[KV_POOL]], prefetch=False).chunks
            hit_count: dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
            restorable = list(range(1, kv_pages + 1))
            for transfer in transfers:
                if not restorable:
                    break
                ref = refs.get(str(transfer.name))
                if ref is None:  # never registered: no page of it can be there
                    restorable = []
                    break
                if transfer.hit_policy is PoolHitPolicy.ALL_PAGES:
                    boundary = client.lookup(hashes[:kv_pages], [ref], prefetch=False).chunks
                    allowed = set(range(1, boundary + 1))
                else:
                    window = max(1, len(transfer.keys) if transfer.keys else 1)
                    present = _present(client, ref, hashes[:kv_pages])
                    # Over every prefix up to kv, as SGLang does: a pool's own hits ignore the others'.
                    allowed = {n for n in range(1, kv_pages + 1) if all(present[max(0, n - window) : n])}
                    boundary = max(allowed, default=0)
                if boundary:
                    hit_count[transfer.name] = boundary
                restorable = [n for n in restorable if n in allowed]
            return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)

        found = self._call("asking which SGLang pages exist", exists) if keys else None
        if found is None:
            if keys:
                self._count(unavailable=1)
            return PoolTransferResult(0, {}, [])
        return found

    # -- SGLang's tensor interface (without interface_v1) -----------------------------------------
    def exists(self, key: str) -> bool:
        """Whether the server holds ``key``'s page."""
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Load ``key`` into the flat tensor ``target_location``; it, or ``None`` on a miss."""
        if not isinstance(target_location, torch.Tensor):
            raise TypeError("tiercache: get() needs target_location, the tensor to load the page into")
        return target_location if self._load_pages([key], [target_location])[0] else None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """:meth:`get` of each key into its target tensor (one round trip for all)."""
        targets = list(target_locations or [])
        if len(targets) != len(keys):
            raise TypeError(f"tiercache: batch_get() got {len(keys)} keys but {len(targets)} target tensors")
        done = self._load_pages(keys, targets)
        return [t if ok else None for t, ok in zip(targets, done)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store tensor ``value`` as ``key``'s page."""
        return self._store_pages([key], [value])[0]

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store each tensor of ``values`` under its key; whether all were stored."""
        values = list(values or [])
        if len(values) != len(keys):
            raise TypeError(f"tiercache: batch_set() got {len(keys)} keys but {len(values)} values")
        return all(self._store_pages(keys, values))

    def clear(self) -> None:
        """Delete this engine's objects (every registered pool's) from every tier of the server."""
        for name in list(self._refs):
            fp = self.pool_fingerprint(name)
            if fp is not None:
                self._clear(fp)

    def _clear(self, fp: Fingerprint) -> None:
        self._call("clearing SGLang pages", lambda c: c.clear(fp))


def _present(client: Client, ref: p.GroupRef, hashes: Sequence[bytes]) -> list[bool]:
    """Whether each of ``hashes`` has its object in group ``ref`` (any tier): one single-page lookup
    per hash, all sent before the first reply is read, so they cost about one round trip."""
    ids = [client.lookup_async([h], [ref], prefetch=False) for h in hashes]
    out: list[bool] = []
    for req in ids:
        reply = None
        while reply is None:
            reply = client.poll(req, wait_s=client.timeout)
        out.append(reply.chunks > 0)
    return out
