"""Per-layer page views at the KV manager's block granularity.

A tiercache object holds, per layer, one *page* per manager block (the scheduler's block ids). The
KV tensor vLLM hands the connector may be finer or laid out differently:

* **Kernel blocks.** When the attention backend cannot run the manager's block size, vLLM splits
  every manager block into ``k`` kernel blocks of ``block_size // k`` tokens: the layer tensor's
  block dimension then counts kernel blocks, and manager block ``b`` is kernel blocks
  ``b*k … b*k+k-1`` (vLLM ``v1/worker/utils.py`` ``map_to_kernel_block_table``: "kernel block j of
  block b is b * kernel_block_stride + j"; ``v1/kv_cache_interface.py`` ``group_kernel_blocks``).
* **Physical order.** vLLM 0.32 views every layer as logical ``[B, H, N, C]`` whose physical order
  follows ``KVCacheLayout`` (e.g. ``LHBNC`` puts heads outside blocks: FlashInfer stores K and V as
  separate head slots, so a page is then several runs). Older vLLMs put K/V planes first
  (``[2, blocks, ...]``): pass ``block_dim=1``.

:func:`page_view` turns such a tensor into a strided uint8 view ``[num_manager_blocks, *runs,
run_bytes]`` over the same memory (no copy): a page is the block's bytes in *physical* order, so
for a block-contiguous unsplit layout it is exactly ``tensor[b]``'s bytes (what the connector always
stored). Gathering pages of arbitrary block ids and scattering them back is plain ``index_select``
/ ``index_copy_`` on that view, which works on CPU and CUDA tensors alike.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from tiercache.client.tensors import feed_array
from tiercache.errors import ConfigError
from tiercache.keys.digest import Digest

#: The bytes :meth:`PageView.copy_out` hashes and copies at a time: small enough to stay in a
#: core's L2 cache between the two, large enough that the per-piece calls cost little.
PIECE_BYTES = 512 * 1024


@dataclass(frozen=True)
class PageView:
    """One layer's pages: ``view[b]`` is manager block ``b``'s bytes (``runs`` strided runs)."""

    layer: str
    view: torch.Tensor  # uint8 [num_blocks, *run_dims, run_bytes], shares the KV memory
    page_bytes: int
    kernel_blocks: int  # kernel blocks per manager block (k)

    @property
    def num_blocks(self) -> int:
        return int(self.view.shape[0])

    @property
    def runs(self) -> int:
        """Contiguous byte runs per page (1 when a page is one contiguous range)."""
        return math.prod(self.view.shape[1:-1])

    def _rows(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` ``[n, page_bytes]`` seen with this view's in-page shape."""
        return flat.view(flat.shape[0], *self.view.shape[1:])

    def gather(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the pages of blocks ``ids`` into ``out`` (``[len(ids), page_bytes]``, same device)."""
        torch.index_select(self.view, 0, ids, out=self._rows(out))

    @cached_property
    def _host(self) -> np.ndarray:
        """:attr:`view` as a numpy array (host memory): slicing one costs a fraction of a tensor's."""
        if self.view.device.type != "cpu":
            raise ValueError(f"layer {self.layer}'s pages are on {self.view.device}, not in host memory")
        host: np.ndarray = self.view.numpy()
        return host

    def copy_out(
        self, digest: Digest, ids: Sequence[int], out: torch.Tensor, piece_bytes: int = PIECE_BYTES
    ) -> None:
        """:meth:`gather` that also feeds ``digest`` the pages' bytes, in order, read from this
        process's own memory (the writer's digest): the pages of blocks ``ids`` into ``out``
        (``[len(ids), page_bytes]``), each run of consecutive blocks in pieces of at most
        ``piece_bytes`` (one page at least), each piece hashed just before it is copied, so the
        copy reads it from cache rather than memory. Host tensors only."""
        host, rows = self._host, self._rows(out).numpy()
        per = max(1, piece_bytes // self.page_bytes)
        i, n = 0, len(ids)
        while i < n:
            j = i + 1
            while j < n and j - i < per and ids[j] == ids[j - 1] + 1:
                j += 1
            piece = host[ids[i] : ids[i] + (j - i)]
            feed_array(digest, piece)
            np.copyto(rows[i:j], piece)
            i = j

    def scatter(self, ids: torch.Tensor, src: torch.Tensor) -> None:
        """Write ``src`` (``[len(ids), page_bytes]``, same device) into the pages of blocks ``ids``.

        Runs of consecutive block ids are written as slice copies: ``index_copy_`` on byte tensors
        moves element by element (measured ~30x slower than a slice ``copy_`` of 64 KiB pages on
        CPU), and vLLM usually hands a request consecutive block ids."""
        rows = self._rows(src)
        if ids.device.type != "cpu":
            self.view.index_copy_(0, ids, rows)
            return
        blocks = ids.tolist()
        i, n = 0, len(blocks)
        while i < n:
            j = i + 1
            while j < n and blocks[j] == blocks[j - 1] + 1:
                j += 1
            self.view[blocks[i] : blocks[i] + (j - i)].copy_(rows[i:j])
            i = j


def page_view(
    name: str,
    tensor: torch.Tensor,
    *,
    page_bytes: int,
    kernel_blocks: int,
    block_dim: int = 0,
) -> PageView:
    """A :class:`PageView` of layer ``name``'s KV ``tensor`` whose dim ``block_dim`` counts kernel
    blocks, ``kernel_blocks`` of them per manager block. Raises :class:`ConfigError` when the tensor
    cannot hold pages of ``page_bytes`` bytes that way."""
    if kernel_blocks < 1:
        raise ValueError(f"kernel_blocks must be >= 1, got {kernel_blocks}")
    t = tensor.movedim(block_dim, 0) if block_dim else tensor
    if t.dim() < 2 or t.shape[0] % kernel_blocks:
        raise ConfigError(
            f"tiercache: layer {name} has a KV tensor of shape {tuple(tensor.shape)} whose block dimension "
            f"{block_dim} is not a multiple of {kernel_blocks} kernel blocks per manager block; this KV layout "
            "is not supported. Please report it with your vLLM version and attention backend."
        )
    es = t.element_size()
    num_blocks = t.shape[0] // kernel_blocks
    # Byte-granular dims of one manager block: (kernel block j, rest of the tensor, element bytes).
    sizes = [kernel_blocks, *t.shape[1:], es]
    strides = [t.stride(0) * es, *(s * es for s in t.stride()[1:]), 1]
    # Physical order inside a page (largest stride first); merge dims that are dense in each other.
    dims = sorted(((st, sz) for sz, st in zip(sizes, strides) if sz != 1), key=lambda d: -d[0])
    runs: list[tuple[int, int]] = []
    for st, sz in dims:
        if runs and runs[-1][0] == st * sz:
            runs[-1] = (st, runs[-1][1] * sz)
        else:
            runs.append((st, sz))
    dense = bool(runs) and runs[-1][0] == 1
    # Pages must not share bytes, within one block or across blocks (with the block dim in place).
    block_stride = t.stride(0) * es * kernel_blocks
    everything = sorted([d for d in (*runs, (block_stride, num_blocks)) if d[1] > 1], key=lambda d: -d[0])
    overlapping = any(a[0] < b[0] * b[1] for a, b in itertools.pairwise(everything))
    found = math.prod(sizes)
    if not dense or overlapping or found != page_bytes:
        raise ConfigError(
            f"tiercache: layer {name}'s KV tensor (shape {tuple(tensor.shape)}, strides {tuple(tensor.stride())}, "
            f"{kernel_blocks} kernel block(s) per manager block) holds pages of {found} bytes "
            f"(byte-dense={dense}, overlapping={overlapping}) but the KV-cache spec says {page_bytes}. "
            "This KV layout is not supported yet; please report it with your vLLM version and attention backend."
        )
    base = torch.empty(0, dtype=torch.uint8, device=t.device)
    base.set_(
        t.untyped_storage(),
        t.storage_offset() * es,
        (num_blocks, *(sz for _, sz in runs)),
        (block_stride, *(st for st, _ in runs)),
    )
    return PageView(name, base, page_bytes, kernel_blocks)


def page_views(
    layers: Sequence[str],
    kv_caches: dict[str, torch.Tensor],
    *,
    page_bytes: int,
    kernel_blocks: int,
    block_dim: int = 0,
) -> list[PageView]:
    """:func:`page_view` of each of ``layers``; a layer without a tensor is a :class:`ConfigError`."""
    out = []
    for name in layers:
        t = kv_caches.get(name)
        if t is None:
            raise ConfigError(
                f"tiercache: layer {name} has no KV tensor among the {len(kv_caches)} registered"
            )
        out.append(
            page_view(name, t, page_bytes=page_bytes, kernel_blocks=kernel_blocks, block_dim=block_dim)
        )
    return out
