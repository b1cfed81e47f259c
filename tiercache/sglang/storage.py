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

Every object the server hands back was verified by it (checksums on L2/L3), and its key carries this
engine's fingerprint, so a foreign or damaged object is a miss, never a page. While the server is
away the backend answers misses and failed stores at once and reconnects in the background (the
connector's :class:`~tiercache.connector.link.ServerLink`): SGLang keeps serving and recomputes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from tiercache.connector.copy import CpuPageCopy
from tiercache.connector.identity import weights_identity
from tiercache.connector.link import ServerLink
from tiercache.errors import ConfigError, ServerError, TierCacheError
from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey
from tiercache.sglang.keys import KV_GROUP, PageGeometry, ShardIdentity, manifest, page_hash
from tiercache.sglang.settings import SGLangSettings
from tiercache.wire import protocol as p
from tiercache.wire.client import Client

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


def _geometry(pool: Any) -> PageGeometry:
    """A host pool's page geometry; :class:`ConfigError` for a pool whose pages are not views."""
    name = type(pool).__name__
    buffer = getattr(pool, "kv_buffer", None)
    if not isinstance(buffer, torch.Tensor):
        raise ConfigError(
            f"tiercache: SGLang host pool {name} keeps its KV in {type(buffer).__name__}, not one tensor; "
            "this pool kind is not supported by the tiercache backend yet (use an MHA or MLA model)"
        )
    page = pool.get_data_page(0, flat=False)
    # The zero-copy path writes loaded pages through this view: it must be the pool's own memory.
    if page.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
        raise ConfigError(
            f"tiercache: SGLang host pool {name} (layout {pool.layout}) returns pages that are copies, "
            "not views of its buffer, so pages could not be loaded in place; this layout is not supported"
        )
    return PageGeometry(
        pool_class=name,
        layout=str(pool.layout),
        dtype=str(pool.dtype).removeprefix("torch."),
        page_size=int(pool.page_size),
        num_layers=int(getattr(pool, "layer_num", 0)),
        page_shape=tuple(int(d) for d in page.shape),
        page_bytes=page.numel() * page.element_size(),
    )


class TierCacheStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang is untyped where mypy runs
    """SGLang HiCache storage backed by a tiercache server (see the module docstring).

    SGLang's dynamic factory builds it as ``TierCacheStorage(storage_config, kwargs)``; the settings
    come from ``storage_config.extra_config`` (:mod:`tiercache.sglang.settings`) and a bad value fails
    the construction with :class:`ConfigError`. The server is reached when SGLang registers its host
    pool: a server that is not there yet is retried in the background (misses meanwhile); one that
    does not fit this engine (chunk size) fails the start-up.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        self.settings = SGLangSettings.from_extra_config(storage_config.extra_config)
        self.storage_config = storage_config
        self.shard = _shard(storage_config, self.settings)
        self.counts = StorageCounts()
        self._counts_lock = threading.Lock()
        self._geometry: PageGeometry | None = None
        self._fingerprint: Fingerprint | None = None
        self._refs: list[p.GroupRef] = []
        self._link: ServerLink | None = None
        self._copy = CpuPageCopy()

    # -- set-up --------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host KV pool, register this engine's layout with the server (start-up)."""
        super().register_mem_pool_host(mem_pool_host)
        self._geometry = _geometry(mem_pool_host)
        s = self.storage_config
        name = f"sglang-tp{s.tp_rank}-pp{s.pp_rank}"
        self._link = ServerLink(self.settings.link, name, self._on_connect)
        try:
            self._link.start()
        except ConfigError:
            self._link.close()  # this engine does not fit the server: nothing may linger
            raise

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """The KV pool again (SGLang's hybrid controller names every pool) is accepted; any other
        pool (Mamba, SWA, ...) is refused: tiercache does not store hybrid state for SGLang yet."""
        if str(host_pool_name) == "kv" and host_pool is getattr(self, "mem_pool_host", None):
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return
        raise ConfigError(
            f"tiercache: SGLang host pool {str(host_pool_name)!r} ({type(host_pool).__name__}) is a hybrid "
            "model's extra pool; the tiercache backend stores only the KV pool so far. Use another "
            "--hicache-storage-backend for this model, or run it without one"
        )

    def _on_connect(self, client: Client) -> None:
        assert self._geometry is not None
        m = manifest(self.shard, self._geometry, client.server.chunk_size)
        self._refs = client.register([(KV_GROUP, m)])
        self._fingerprint = Fingerprint(self._refs[0].fingerprint)

    @property
    def fingerprint(self) -> Fingerprint | None:
        """This engine's layout fingerprint (``None`` until the server was first reached)."""
        return self._fingerprint

    def counters(self) -> dict[str, int]:
        """A snapshot of :class:`StorageCounts` plus the link's outages."""
        with self._counts_lock:
            out = asdict(self.counts)
        out["outages"] = self._link.outages if self._link is not None else 0
        return out

    def close(self) -> None:
        """Disconnect (SGLang calls it when the backend is detached)."""
        if self._link is not None:
            self._link.close()

    # -- plumbing ------------------------------------------------------------------------------
    def _count(self, **delta: int) -> None:
        with self._counts_lock:
            for name, n in delta.items():
                setattr(self.counts, name, getattr(self.counts, name) + n)

    def _keys(self, keys: Sequence[str]) -> list[ObjectKey]:
        assert self._fingerprint is not None
        return [ObjectKey(self._fingerprint, KV_GROUP, page_hash(k)) for k in keys]

    def _call(self, what: str, fn: Callable[[Client], T]) -> T | None:
        """``fn(client)``, or ``None`` when the server is away or the call failed (then the link
        goes down and reconnects in the background)."""
        link = self._link
        client = link.client() if link is not None else None
        if client is None or self._fingerprint is None:
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

    def _pages(self, host_indices: torch.Tensor, n: int) -> list[torch.Tensor] | None:
        """The host pool's page views for ``n`` pages at ``host_indices`` (token indices)."""
        geometry = self._geometry
        if geometry is None:
            return None
        size = geometry.page_size
        if host_indices.numel() != n * size:
            log.error(
                "tiercache: SGLang passed %d host indices for %d pages of %d tokens; nothing moved",
                host_indices.numel(),
                n,
                size,
            )
            return None
        starts = host_indices[::size].tolist()
        return [self.mem_pool_host.get_data_page(int(i), flat=False) for i in starts]

    def _store(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        def store(client: Client) -> int:
            objects = self._keys(keys)
            sizes = [t.numel() * t.element_size() for t in pages]
            slots = client.reserve(list(zip(objects, sizes)))
            arena = client.arena()
            tokens = [s.token for s in slots if s is not None]
            try:
                for slot, page in zip(slots, pages):
                    assert slot is not None
                    dst = self._copy.host(arena, slot.offset, slot.nbytes)
                    dst.view(page.dtype).view(page.shape).copy_(page)
            except BaseException:
                client.abort(tokens)
                raise
            return client.commit(tokens)

        done = self._call("storing SGLang pages", store) if keys else 0
        ok = done == len(keys)
        if done is None:
            self._count(unavailable=1)
        self._count(stored=len(keys) if ok else 0, store_failed=0 if ok else len(keys))
        return [ok] * len(keys)

    def _load(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        def load(client: Client) -> int:
            objects = self._keys(keys)
            # All in L1 (the common case): pin them, answered on the server's request loop without
            # the I/O executor's hop; the release says which leases had expired during the copy.
            slots = client.pin(objects)
            held = [s.token for s in slots if s is not None]
            if all(s is not None for s in slots):
                try:
                    copied = self._copy_in(client, objects, slots, pages)
                except BaseException:
                    client.release(held)
                    raise
                lost = client.release_leases(held)
                # A slot whose lease expired may have been reused: a miss from there on.
                return next(
                    (i for i, s in enumerate(slots[:copied]) if s is not None and s.token in lost), copied
                )
            if held:
                client.release(held)
            # Some are not in L1: a lookup pins the leading run of hits, promoting them from disk/S3.
            found = client.lookup([o.prefix_hash for o in objects], self._refs, max_chunks=len(keys))
            if not found.chunks or not found.ticket:
                return 0
            try:
                if found.pending:
                    found = client.wait_ticket(found.ticket, timeout=self.settings.link.timeout_s)
                if found.state is not p.TicketStateName.READY:
                    return 0
                by_key = {s.key: s for s in found.slots}
                ready = objects[: found.ready_chunks]
                return self._copy_in(client, ready, [by_key.get(o.to_bytes()) for o in ready], pages)
            finally:
                client.release_ticket(found.ticket)

        loaded = self._call("loading SGLang pages", load) if keys else 0
        if loaded is None:
            self._count(unavailable=1)
            loaded = 0
        self._count(loaded=loaded, load_missed=len(keys) - loaded)
        return [i < loaded for i in range(len(keys))]

    def _copy_in(
        self,
        client: Client,
        objects: Sequence[ObjectKey],
        slots: Sequence[p.Slot | None],
        pages: Sequence[torch.Tensor],
    ) -> int:
        """Copy each slot into its page, in order, up to the first that is missing or of another
        size; how many were copied."""
        arena = client.arena()
        for i, (slot, page) in enumerate(zip(slots, pages)):
            if slot is None or slot.nbytes != page.numel() * page.element_size():
                return i
            src = self._copy.host(arena, slot.offset, slot.nbytes)
            page.copy_(src.view(page.dtype).view(page.shape))
        return min(len(slots), len(pages))

    # -- SGLang's zero-copy interface ------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, the server holds (any tier); one round trip."""
        self._count(exists_calls=1)

        def exists(client: Client) -> int:
            hashes = [o.prefix_hash for o in self._keys(keys)]
            return client.lookup(hashes, self._refs, prefetch=False).chunks

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
        return self._store(keys, pages)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Load ``keys`` into the host pool's pages at ``host_indices``; the leading run of hits is
        ``True``, everything from the first miss ``False``."""
        pages = self._pages(host_indices, len(keys))
        if pages is None:
            self._count(load_missed=len(keys))
            return [False] * len(keys)
        return self._load(keys, pages)

    # -- SGLang's tensor interface (without interface_v1) -----------------------------------------
    def exists(self, key: str) -> bool:
        """Whether the server holds ``key``'s page."""
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Load ``key`` into the flat tensor ``target_location``; it, or ``None`` on a miss."""
        if not isinstance(target_location, torch.Tensor):
            raise TypeError("tiercache: get() needs target_location, the tensor to load the page into")
        return target_location if self._load([key], [target_location])[0] else None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """:meth:`get` of each key into its target tensor (one round trip for all)."""
        targets = list(target_locations or [])
        if len(targets) != len(keys):
            raise TypeError(f"tiercache: batch_get() got {len(keys)} keys but {len(targets)} target tensors")
        done = self._load(keys, targets)
        return [t if ok else None for t, ok in zip(targets, done)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store tensor ``value`` as ``key``'s page."""
        return self._store([key], [value])[0]

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store each tensor of ``values`` under its key; whether all were stored."""
        values = list(values or [])
        if len(values) != len(keys):
            raise TypeError(f"tiercache: batch_set() got {len(keys)} keys but {len(values)} values")
        return all(self._store(keys, values))

    def clear(self) -> None:
        """Delete this engine's objects (its fingerprint's) from every tier of the server."""
        fp = self._fingerprint
        if fp is not None:
            self._call("clearing SGLang pages", lambda c: c.clear(fp))
