"""How SGLang's host pools are laid out as pages, for :mod:`tiercache.sglang.storage`: this rank's
shard identity, each pool's page geometry (what goes into its fingerprint), and where a page is read
from on a store and written to on a load (a view of the pool, or SGLang's own flat-page calls).
Pools this backend cannot store are refused here (:class:`UnsupportedPoolError`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from tiercache.errors import ConfigError
from tiercache.keys.weights import weights_identity
from tiercache.sglang.keys import KV_POOL, POOL_GROUPS, PageGeometry, ShardIdentity
from tiercache.sglang.settings import SGLangSettings

log = logging.getLogger(__name__)


def shard_identity(config: HiCacheStorageConfig, settings: SGLangSettings) -> ShardIdentity:
    """Which engine shard this backend stores for (model, weights, parallel ranks, layout), as SGLang's
    ``storage_config`` names it; part of every pool's manifest."""
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


def pool_geometry(pool: Any, name: str = KV_POOL) -> tuple[PageGeometry, bool]:
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
class FlatPage:
    """A page of a pool that is not kept as one view (Mamba): loaded with SGLang's own
    ``set_from_flat_data_page``, straight from the arena slot (one copy per state)."""

    host: Any
    index: int
    nbytes: int

    def write(self, src: torch.Tensor) -> None:
        self.host.set_from_flat_data_page(self.index, src)


#: Where a loaded page goes: a view of the host pool, or a flat page written by the pool itself.
Sink: TypeAlias = "torch.Tensor | FlatPage"


@dataclass(frozen=True, slots=True)
class HostPool:
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
        return [FlatPage(self.host, i, self.geometry.page_bytes) for i in starts]
