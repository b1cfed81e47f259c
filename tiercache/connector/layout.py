"""Layout discovery: from vLLM's config to tiercache object groups and their manifests.

Both halves of the connector call :func:`derive_layout` with the same engine config, so the scheduler
(which never sees a KV tensor) and the worker compute the same fingerprints without talking to each
other. The worker then checks the derived facts against the tensors it was given and the attention
backend its layers actually use (:func:`verify_kv_caches`), and refuses to start on a mismatch: a
wrong fingerprint would let incompatible engines read each other's pages.

Object groups: one per (vLLM KV-cache group, parallel rank): ``object_group = kv_group * world + rank``
with ``world = tp * pp``. Each rank stores its own pages; a lookup asks for every rank's group, so a
hit means every rank can load. An object (one chunk of one group) is the pages of every layer of that
group for the ``chunk_size / block_size`` blocks covering the chunk (the group's own block size),
layer-major::

    [layer 0: block 0 page, block 1 page, ...][layer 1: ...]...

Supported group kinds: full attention (``FullAttentionSpec``), sliding window (``SlidingWindowSpec``,
e.g. Gemma 3, gpt-oss): a sliding group is registered as ``GroupKind.SLIDING_WINDOW`` with its window in
tokens, so the server's restorable-prefix rule asks it only for the trailing window chunks of a hit;
and recurrent state (``MambaSpec`` in ``mamba_cache_mode="align"``: Mamba, Gated DeltaNet, e.g.
Qwen3-Next), registered as ``GroupKind.RECURRENT``. A recurrent object is different: it is not the
pages of the chunk's blocks but the *state after the chunk*, one state page per layer::

    [layer 0: state page at the chunk's end][layer 1: ...]...

keyed by the chunk's prefix hash, so a hit of ``b`` chunks needs only the state object of chunk
``b - 1`` (``GroupLayout.needed_chunks``). Only the unpadded state bytes are stored (vLLM pads Mamba
pages to the attention page size). The engine settings recurrent state needs are checked at start-up
by :mod:`tiercache.connector.recurrent`.

Groups may use different block sizes (Gemma 4: vLLM grows the block size of the group with the
smaller page until all pages are equal, so its sliding group has 64-token blocks and its full group
32-token ones); the scheduler then works in the LCM of them. The chunk size must be a multiple of
every group's block size (:func:`check_block_sizes`); :mod:`tiercache.connector.blockmap` maps
chunks to each attention group's blocks.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiercache.connector.kernel_blocks import (
    attention_backend,
    derive_kernel_block_size,
)
from tiercache.errors import ConfigError
from tiercache.keys import Fingerprint, GroupKind, LayoutManifest, restore
from tiercache.keys.weights import weights_identity

if TYPE_CHECKING:
    from tiercache.connector.pages import PageView

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """One object group: which vLLM KV-cache group and rank it holds, and what its objects look like."""

    object_group: int
    kv_group: int
    rank: int
    layer_names: tuple[str, ...]
    block_size: int
    blocks_per_chunk: int
    page_bytes: int
    manifest: LayoutManifest
    window_tokens: int = 0  # > 0 for a sliding-window group
    recurrent: bool = False  # objects hold the state after their chunk (``blocks_per_chunk`` is 1)

    @property
    def is_sliding(self) -> bool:
        return self.window_tokens > 0

    @property
    def is_recurrent(self) -> bool:
        return self.recurrent

    @property
    def kind(self) -> GroupKind:
        """What this group's objects hold, as the restorable-prefix rule sees it."""
        if self.recurrent:
            return GroupKind.RECURRENT
        return GroupKind.SLIDING_WINDOW if self.is_sliding else GroupKind.FULL_ATTENTION

    def window_chunks(self, chunk_size: int) -> int:
        """Trailing chunks a hit boundary needs from this group (0 unless sliding)."""
        return restore.window_chunks(self.window_tokens, chunk_size) if self.is_sliding else 0

    def needed_chunks(self, boundary: int, chunk_size: int) -> range:
        """The chunks of this group a hit of ``boundary`` chunks must load: the server's rule
        (:mod:`tiercache.keys.restore`), so what a lookup reports is exactly what gets loaded."""
        return restore.needed_chunks(self.kind, boundary, self.window_chunks(chunk_size))

    @property
    def object_bytes(self) -> int:
        return len(self.layer_names) * self.blocks_per_chunk * self.page_bytes

    @property
    def fingerprint(self) -> Fingerprint:
        return self.manifest.fingerprint()


@dataclass(frozen=True, slots=True)
class EngineLayout:
    """Every object group of one engine (all ranks), and the engine's scheduler block size."""

    groups: tuple[GroupLayout, ...]
    world_size: int
    scheduler_block_size: int
    chunk_size: int

    def for_rank(self, rank: int) -> list[GroupLayout]:
        return [g for g in self.groups if g.rank == rank]

    @property
    def has_sliding(self) -> bool:
        return any(g.is_sliding for g in self.groups)

    @property
    def has_recurrent(self) -> bool:
        return any(g.is_recurrent for g in self.groups)

    def recurrent_kv_groups(self) -> set[int]:
        """vLLM KV-cache groups that hold recurrent state."""
        return {g.kv_group for g in self.groups if g.is_recurrent}

    def kv_group_windows(self) -> dict[int, int]:
        """vLLM KV-cache group → sliding window in tokens (only sliding groups)."""
        return {g.kv_group: g.window_tokens for g in self.groups if g.is_sliding}

    def kv_group_block_sizes(self) -> list[int]:
        """Block size in tokens of each vLLM KV-cache group, indexed by KV-cache group."""
        sizes = {g.kv_group: g.block_size for g in self.groups}
        return [sizes[kv] for kv in range(len(sizes))]


def _pages() -> Any:
    # Imports torch: only the functions that deal with tensors need it.
    from tiercache.connector import pages

    return pages


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_backend_name(vllm_config: Any, spec: Any) -> str:
    """The attention backend vLLM picks for layers of ``spec``, resolved the way the layers do it.

    Runs in the scheduler process too (which builds no model). Falls back to the configured backend
    or ``"unresolved"``; the worker compares against what its layers really use.
    """
    try:
        backend = attention_backend(vllm_config, spec)
        return str(backend.get_name())
    except Exception as exc:  # unknown selector signature: let the worker's check decide
        log.debug("could not resolve the attention backend from the config: %s", exc)
        configured = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
        return str(getattr(configured, "name", configured) or "unresolved")


def _platform_extras() -> tuple[tuple[str, str], ...]:
    """Facts that change page bytes without showing in the spec: device kind, vLLM version, and on
    CPU the kernel's ISA packing (on AVX2 the CPU backend stores K transposed)."""
    extras: dict[str, str] = {}
    try:
        import vllm
        from vllm.platforms import current_platform

        extras["vllm"] = str(getattr(vllm, "__version__", "?"))
        extras["device"] = str(current_platform.device_type)
        if current_platform.device_type == "cpu":
            import torch

            extras["cpu_isa"] = str(torch.backends.cpu.get_cpu_capability())
    except Exception as exc:
        log.debug("platform facts unavailable: %s", exc)
    return tuple(sorted(extras.items()))


def check_block_sizes(chunk_size: int, scheduler_block_size: int, group_block_sizes: list[int]) -> None:
    """Raise :class:`ConfigError` unless ``chunk_size`` is a multiple of every block size.

    The message names N, the LCM of the scheduler's and every group's block size (what vLLM's
    scheduler aligns to with groups of different block sizes), since a multiple of N is the fix.
    """
    sizes = [scheduler_block_size, *group_block_sizes]
    if any(b <= 0 for b in sizes):
        raise ConfigError(f"vLLM reported a non-positive KV block size among {sizes}; please report this")
    n = math.lcm(*sizes)
    if chunk_size % n:
        groups = ""
        if len(set(group_block_sizes)) > 1:
            listed = ", ".join(f"group {i}: {b}" for i, b in enumerate(group_block_sizes))
            groups = f"; its KV-cache groups use different block sizes ({listed}) and N is their least common multiple"
        raise ConfigError(
            f"the tiercache server's --chunk-size {chunk_size} is not a multiple of the vLLM engine's "
            f"block size {n} (N{groups}); restart the server with --chunk-size {n} or a multiple of it "
            f"(e.g. {n * max(1, -(-chunk_size // n))}), or run vLLM with a --block-size that makes N divide "
            f"{chunk_size}"
        )


def _spec_kind(spec: Any) -> str:
    """``full``, ``sliding`` or the reason this connector cannot hold the spec's state."""
    name = type(spec).__name__
    if (
        any(c.__name__ == "FullAttentionSpec" for c in type(spec).__mro__)
        and not getattr(spec, "sliding_window", None)
        and not getattr(spec, "attention_chunk_size", None)
    ):
        return "full"
    if name == "SlidingWindowSpec" and int(getattr(spec, "sliding_window", 0) or 0) > 0:
        if int(getattr(spec, "extra_retained_tokens", 0) or 0):
            return "a sliding window with extra retained tokens (multi-module spec decoding)"
        return "sliding"
    if any(c.__name__ == "MambaSpec" for c in type(spec).__mro__):
        if int(getattr(spec, "num_speculative_blocks", 0) or 0):
            return "recurrent state with speculative blocks (spec decoding relocates them)"
        return "recurrent"
    if "Mamba" in name:
        return "recurrent state of an unknown spec"
    return name


def check_group_specs(specs: list[Any]) -> None:
    """Raise :class:`ConfigError` unless every KV-cache group is full attention, a sliding window or
    recurrent state (``MambaSpec``). (Block sizes may differ between groups; :func:`check_block_sizes`
    checks them against the chunk.)"""
    for i, spec in enumerate(specs):
        kind = _spec_kind(spec)
        if kind not in ("full", "sliding", "recurrent"):
            raise ConfigError(
                f"KV-cache group {i} is {type(spec).__name__} ({kind}): the tiercache connector supports "
                "full-attention, sliding-window and recurrent-state (Mamba/GDN, align mode) groups only; "
                "chunked-local, MLA-sparse and cross-attention groups and speculative decoding with "
                "recurrent layers are not supported yet. Remove the tiercache kv-transfer-config for "
                "this model."
            )


def _vllm_group_ranks() -> tuple[int, int, int, int]:
    """``(tp_rank, tp_size, pp_rank, pp_size)`` of this worker from vLLM's process groups."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    tp, pp = get_tp_group(), get_pp_group()
    return int(tp.rank_in_group), int(tp.world_size), int(pp.rank_in_group), int(pp.world_size)


def parallel_rank(
    parallel_config: Any, group_ranks: Callable[[], tuple[int, int, int, int]] = _vllm_group_ranks
) -> int:
    """This worker's rank among the engine's ``tp * pp`` ranks, ``pp_rank * tp + tp_rank``: the rank
    :func:`derive_layout` numbers object groups by (``EngineLayout.for_rank``).

    A single-rank engine is rank 0 without asking vLLM. With several ranks the rank must come from
    vLLM's TP/PP groups (``group_ranks``), whose sizes must be the config's; anything else raises
    :class:`ConfigError`: a guessed rank would make two ranks store their different KV heads under
    one object group and fingerprint, and a later engine would load one rank's heads into the other.
    """
    tp = int(getattr(parallel_config, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(parallel_config, "pipeline_parallel_size", 1) or 1)
    if tp * pp == 1:
        return 0
    try:
        tp_rank, tp_size, pp_rank, pp_size = group_ranks()
    except Exception as exc:
        raise ConfigError(
            f"tiercache: cannot tell this worker's rank from vLLM's parallel groups (tensor parallel {tp}, "
            f"pipeline parallel {pp}): {exc!r}. Please report this with your vLLM version."
        ) from exc
    if (tp_size, pp_size) != (tp, pp) or not (0 <= tp_rank < tp and 0 <= pp_rank < pp):
        raise ConfigError(
            f"tiercache: vLLM's parallel groups (tensor parallel rank {tp_rank} of {tp_size}, pipeline "
            f"parallel rank {pp_rank} of {pp_size}) do not match the config (tensor parallel {tp}, pipeline "
            f"parallel {pp}); the connector cannot tell which objects are this worker's, so it refuses to "
            "start. Please report this with your vLLM version."
        )
    return pp_rank * tp + tp_rank


def cpu_in_step_checkpoints(specs: list[Any]) -> bool:
    """Whether this engine is vLLM's CPU build and a recurrent group exports prefill checkpoints from
    inside a step (``MambaSpec.num_prefill_checkpoint_blocks > 0``: Mamba2, e.g. Granite 4). vLLM 0.32's
    CPU chunk scan ignores ``return_intermediate_states``, so such a step fails in ``mamba_mixer2``."""
    if not any(
        int(getattr(s, "num_prefill_checkpoint_blocks", 0) or 0) > 0
        for s in specs
        if _spec_kind(s) == "recurrent"
    ):
        return False
    return dict(_platform_extras()).get("device") == "cpu"


@dataclass(frozen=True, slots=True)
class _EngineFacts:
    """What every manifest of one engine shares, gathered once by :func:`derive_layout`."""

    vllm_config: Any
    kv_cache_config: Any
    model: Any  # model_config.model, as vLLM gives it (the manifest holds its str)
    revision: str
    layout_name: str
    cache_dtype: str
    extras: tuple[tuple[str, str], ...]
    tp: int
    pp: int
    dcp: int
    chunk_size: int


@dataclass(frozen=True, slots=True)
class _GroupFacts:
    """What one vLLM KV-cache group's manifests and objects share (the same for every rank)."""

    spec: Any
    layers: tuple[str, ...]
    block: int
    page: int
    unpadded: int
    window: int
    recurrent: bool
    backend: str
    kind: GroupKind
    kernel: int
    stored_page: int
    state_shapes: tuple[tuple[int, ...], ...]
    state_dtypes: tuple[str, ...]
    spec_extra: tuple[tuple[str, str], ...]


def _parallel_sizes(parallel: Any) -> tuple[int, int, int]:
    """``(tp, pp, dcp)`` of ``parallel_config``, or :class:`ConfigError` for prefill context parallelism."""
    tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    dcp = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    if pcp > 1:
        # Prefill context parallel ranks hold different tokens' KV for the same TP rank; object groups
        # are per TP/PP rank only, so they would overwrite each other's pages.
        raise ConfigError(
            f"tiercache: prefill context parallelism (prefill_context_parallel_size={pcp}) is not supported "
            "by the tiercache connector yet; run without it or remove the tiercache kv-transfer-config"
        )
    return tp, pp, dcp


def _model_revision(model_config: Any, weights_id: str | None) -> str:
    """The weights identity manifests carry; warns when there is none (KV shared by model name only)."""
    revision = weights_identity(str(model_config.model), getattr(model_config, "revision", None), weights_id)
    if revision == "unknown":
        log.warning(
            "tiercache: no weights identity for model %s (no --revision and no local checkpoint files); "
            "KV is shared by model name only. Set kv_connector_extra_config weights_id to be safe.",
            model_config.model,
        )
    return revision


def _group_facts(engine: _EngineFacts, group_spec: Any) -> _GroupFacts:
    """One KV-cache group's facts: a recurrent group's state kernels and state layout, an attention
    group's backend, kernel block size and heads."""
    spec = group_spec.kv_cache_spec
    page = int(spec.page_size_bytes)
    unpadded = int(getattr(spec, "real_page_size_bytes", page))
    block = int(spec.block_size)
    layers = tuple(group_spec.layer_names)
    window = int(getattr(spec, "sliding_window", 0) or 0)
    recurrent = _spec_kind(spec) == "recurrent"
    if recurrent:
        # The state kernels (mamba_type) and the conv-state layout decide what the bytes mean.
        mamba_type = getattr(spec, "mamba_type", "?")
        backend = f"mamba:{getattr(mamba_type, 'value', mamba_type)}"
        kind, stored_page = GroupKind.RECURRENT, unpadded
        kernel = block  # state pages are never split into kernel blocks
        state_shapes = tuple(tuple(int(d) for d in shape) for shape in spec.shapes)
        state_dtypes = tuple(_dtype_name(d) for d in spec.dtypes)
        spec_extra: tuple[tuple[str, str], ...] = (
            ("conv_state_layout", os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT", "default")),
            ("mamba_cache_mode", str(getattr(spec, "mamba_cache_mode", "?"))),
        )
    else:
        backend = resolve_backend_name(engine.vllm_config, spec)
        kernel = derive_kernel_block_size(engine.vllm_config, engine.kv_cache_config, layers, spec)
        kind = GroupKind.SLIDING_WINDOW if window else GroupKind.FULL_ATTENTION
        stored_page, state_shapes, state_dtypes = page, (), ()
        spec_extra = (("num_kv_heads", str(spec.num_kv_heads)), ("head_size", str(spec.head_size)))
    return _GroupFacts(
        spec=spec,
        layers=layers,
        block=block,
        page=page,
        unpadded=unpadded,
        window=window,
        recurrent=recurrent,
        backend=backend,
        kind=kind,
        kernel=kernel,
        stored_page=stored_page,
        state_shapes=state_shapes,
        state_dtypes=state_dtypes,
        spec_extra=spec_extra,
    )


def _manifest(engine: _EngineFacts, group: _GroupFacts, rank: int) -> LayoutManifest:
    """The manifest of ``group`` on parallel rank ``rank`` (``pp_rank * tp + tp_rank``)."""
    spec, layers, tp = group.spec, group.layers, engine.tp
    return LayoutManifest(
        model_id=str(engine.model),
        model_revision=engine.revision,
        kv_dtype=_dtype_name(spec.dtypes[0] if group.recurrent else spec.dtype),
        attention_backend=group.backend,
        kv_layout=engine.layout_name,
        kernel_block_size=group.kernel,
        manager_block_size=group.block,
        page_bytes=group.page,
        page_bytes_unpadded=group.unpadded,
        group_kind=group.kind,
        sliding_window=group.window or None,
        state_shapes=group.state_shapes,
        state_dtypes=group.state_dtypes,
        chunk_size=engine.chunk_size,
        num_layers=len(layers),
        kv_quantization="none" if engine.cache_dtype == "auto" else engine.cache_dtype,
        tp_size=tp,
        tp_rank=rank % tp,
        pp_size=engine.pp,
        pp_rank=rank // tp,
        dcp_size=engine.dcp,
        extra=(
            *engine.extras,
            ("spec", type(spec).__name__),
            ("layers", ",".join(layers)),
            *group.spec_extra,
        ),
    )


def _group_layouts(engine: _EngineFacts, kv_group: int, group_spec: Any) -> list[GroupLayout]:
    """The object groups of one vLLM KV-cache group, one per parallel rank, in rank order."""
    group = _group_facts(engine, group_spec)
    world = engine.tp * engine.pp
    return [
        GroupLayout(
            object_group=kv_group * world + rank,
            kv_group=kv_group,
            rank=rank,
            layer_names=group.layers,
            block_size=group.block,
            blocks_per_chunk=1 if group.recurrent else engine.chunk_size // group.block,
            page_bytes=group.stored_page,
            manifest=_manifest(engine, group, rank),
            window_tokens=group.window,
            recurrent=group.recurrent,
        )
        for rank in range(world)
    ]


def derive_layout(
    vllm_config: Any, kv_cache_config: Any, chunk_size: int, weights_id: str | None = None
) -> EngineLayout:
    """Object groups and manifests of this engine, from its config alone (no tensors needed)."""
    model_config = vllm_config.model_config
    tp, pp, dcp = _parallel_sizes(vllm_config.parallel_config)
    world = tp * pp
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    check_group_specs(specs)
    group_blocks = [int(s.block_size) for s in specs]
    # vLLM's scheduler aligns to the LCM of the groups' block sizes when they differ (it keeps
    # cache_config.block_size as the user's value); with one size both agree.
    scheduler_block = math.lcm(int(vllm_config.cache_config.block_size), *group_blocks)
    check_block_sizes(chunk_size, scheduler_block, group_blocks)
    # Evaluated in keyword order: the weights identity (and its warning) before the platform facts.
    engine = _EngineFacts(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        model=model_config.model,
        revision=_model_revision(model_config, weights_id),
        layout_name=str(getattr(kv_cache_config, "kv_cache_layout", None) or "unknown"),
        cache_dtype=str(vllm_config.cache_config.cache_dtype),
        extras=_platform_extras(),
        tp=tp,
        pp=pp,
        dcp=dcp,
        chunk_size=chunk_size,
    )
    groups: list[GroupLayout] = []
    for kv_group, group_spec in enumerate(kv_cache_config.kv_cache_groups):
        groups.extend(_group_layouts(engine, kv_group, group_spec))
    return EngineLayout(tuple(groups), world, scheduler_block, chunk_size)


def verify_kv_caches(
    groups: list[GroupLayout], kv_caches: dict[str, Any], forward_context: dict[str, Any] | None
) -> dict[int, list[PageView]]:
    """Check the derived layout against the worker's real tensors and layers; raise on mismatch.

    Returns per KV-cache group the layers' :class:`PageView` at manager-block granularity: each
    layer's block dimension holds ``manager_block_size // kernel_block_size`` kernel blocks per
    manager block, and a page (possibly several strided runs) must be ``page_bytes`` long. For a
    recurrent layer the page is its ``[blocks, 1, 1, state bytes]`` view, whose block stride is the
    padded page: only the unpadded state bytes are a page.
    """
    pages: dict[int, list[PageView]] = {}
    for g in groups:
        m = g.manifest
        pages[g.kv_group] = _pages().page_views(
            g.layer_names,
            kv_caches,
            page_bytes=g.page_bytes,
            kernel_blocks=m.manager_block_size // m.kernel_block_size,
        )
        for name in g.layer_names:
            layer = (forward_context or {}).get(name)
            if g.is_recurrent:
                continue  # no attention backend: the manifest names the state kernels (mamba_type)
            if layer is not None and hasattr(layer, "get_attn_backend"):
                actual = str(layer.get_attn_backend().get_name())
                if actual != g.manifest.attention_backend:
                    raise ConfigError(
                        f"tiercache: layer {name} runs attention backend {actual} but the connector derived "
                        f"{g.manifest.attention_backend} from the config; the fingerprint would be wrong, "
                        "so the connector refuses to start. Please report this with your vLLM version."
                    )
    return pages
