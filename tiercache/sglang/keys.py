"""SGLang page keys as tiercache object keys, and the manifest that keeps SGLang's pages apart.

SGLang names a page by a hex string: a SHA-256 chained over the prefix's tokens, seeded with the
request's namespace (its LoRA ``extra_key`` and ``cache_salt``), so it already identifies the
prefix. tiercache's ``prefix_hash`` is the xxh3-128 of that string under a domain tag of its own:
no vLLM chain hash (seeded ``tiercache-chain-v1``) can equal it except by a 128-bit collision.

The fingerprint is what makes a hit safe: a :class:`~tiercache.keys.LayoutManifest` of everything
that decides what a page's bytes mean on the SGLang side — the engine (``sglang``), the model and its
weights identity, dtype, page size and bytes, the host pool's class, layout and page shape, MLA, the
head split, and the TP/PP/CP/DCP shard. A hybrid model's extra pools (SWA, Mamba) get a manifest
and an object group of their own (:data:`POOL_GROUPS`), naming the pool: an SWA or Mamba page under
the same SGLang page key as a KV page is another object, and never matches it. vLLM's manifests always say another ``attention_backend``
and ``kv_layout``, so an SGLang page and a vLLM page never share a fingerprint, and neither do two
SGLang engines whose pages differ in any of these.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from tiercache.errors import ConfigError
from tiercache.keys.fingerprint import GroupKind, LayoutManifest

#: The ``attention_backend`` of every manifest this backend registers: how ``inspect`` tells
#: SGLang's objects from vLLM's.
ENGINE = "sglang-hicache"
_DOMAIN = b"tiercache-sglang-page-v1\0"
#: SGLang's name of its KV pool (``PoolName.KV``): the pool every model has.
KV_POOL = "kv"
#: The object group of each SGLang pool this backend stores (SGLang's ``PoolName`` values). Fixed
#: here rather than taken from SGLang's enum order, so that a later SGLang reordering its enum does
#: not move a pool's objects to another group.
POOL_GROUPS: dict[str, int] = {KV_POOL: 0, "swa": 1, "mamba": 2}
#: The object group of SGLang's KV pool.
KV_GROUP = POOL_GROUPS[KV_POOL]


def page_hash(key: str) -> bytes:
    """The 16-byte ``prefix_hash`` of SGLang page key ``key``."""
    return xxhash.xxh3_128_digest(_DOMAIN + key.encode())


@dataclass(frozen=True, slots=True)
class PageGeometry:
    """What one host pool page is: read off SGLang's host pool when it is registered."""

    pool_class: str
    layout: str
    dtype: str
    page_size: int
    num_layers: int
    page_shape: tuple[int, ...]
    page_bytes: int
    #: A pool whose page is several states (Mamba: the temporal and conv states): their shapes and
    #: dtypes, as the pool declares them; empty for KV pools (``page_shape`` and ``dtype`` say it).
    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_dtypes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ShardIdentity:
    """The SGLang side's model and parallel shard (from ``HiCacheStorageConfig``)."""

    model: str
    weights: str
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    cp_rank: int
    cp_size: int
    dcp_rank: int
    dcp_size: int
    is_mla: bool
    split_heads: bool
    tp_lcm_size: int | None
    page_first: bool


def manifest(
    shard: ShardIdentity, page: PageGeometry, chunk_size: int, pool: str = KV_POOL
) -> LayoutManifest:
    """The manifest of this engine's pages of SGLang pool ``pool``; raises :class:`ConfigError` if
    the server's chunk size is not SGLang's page size (one tiercache object holds one SGLang page).

    An extra pool's page is what SGLang keeps for one KV page (an SWA pool: that page's tokens of the
    sliding layers; a Mamba pool: one state slot, the state after that page): its chunk is the KV
    page's, and its own slot count per page goes into ``extra``.
    """
    if pool == KV_POOL and chunk_size != page.page_size:
        raise ConfigError(
            f"the tiercache server's chunk size is {chunk_size} tokens but SGLang's page size is "
            f"{page.page_size}: one tiercache object holds one SGLang page; start SGLang with "
            f"--page-size {chunk_size}, or the server with --chunk-size {page.page_size}"
        )
    # MLA KV is the same on every TP rank of a DCP shard (SGLang shares it): the TP rank is not
    # part of what the bytes mean then, so every rank reads what one wrote. Only the KV pool: SGLang
    # keeps a Mamba state sharded by TP rank even for an MLA model, and the other pools likewise.
    shared = shard.is_mla and pool == KV_POOL
    tp_size, tp_rank = (1, 0) if shared else (shard.tp_size, shard.tp_rank)
    extra: list[tuple[str, str]] = [
        ("engine", "sglang"),
        ("host_pool", page.pool_class),
        ("page_shape", "x".join(str(d) for d in page.page_shape)),
        ("mla", str(shard.is_mla).lower()),
        ("split_heads", str(shard.split_heads).lower()),
        ("tp_lcm_size", str(shard.tp_lcm_size or 0)),
        ("page_first", str(shard.page_first).lower()),
        ("cp", f"{shard.cp_rank}/{shard.cp_size}"),
    ]
    if pool != KV_POOL:
        # Named only off the KV pool, so KV fingerprints stay what they were before extra pools.
        extra += [("sglang_pool", pool), ("pool_page_size", str(page.page_size))]
    block = page.page_size if pool == KV_POOL else chunk_size
    return LayoutManifest(
        model_id=shard.model,
        model_revision=shard.weights,
        kv_dtype=page.dtype,
        attention_backend=ENGINE,
        kv_layout=f"sglang:{page.layout}",
        kernel_block_size=block,
        manager_block_size=block,
        page_bytes=page.page_bytes,
        page_bytes_unpadded=page.page_bytes,
        # Every object of every pool is one whole page: SGLang's hit policies (ALL_PAGES,
        # TRAILING_PAGES) are applied by the backend, per call, over per-group lookups.
        group_kind=GroupKind.FULL_ATTENTION,
        chunk_size=chunk_size,
        num_layers=page.num_layers,
        state_shapes=page.state_shapes,
        state_dtypes=page.state_dtypes,
        tp_size=tp_size,
        tp_rank=tp_rank,
        pp_size=shard.pp_size,
        pp_rank=shard.pp_rank,
        dcp_size=shard.dcp_size,
        dcp_rank=shard.dcp_rank,
        extra=tuple(sorted(extra)),
    )
