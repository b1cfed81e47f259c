"""Host pools for the SGLang backend tests: SGLang 0.5.23's own ``MambaPoolHost``, and a KV pool
with the memory layout of its ``MHATokenToKVPoolHost`` (used for the KV and the SWA pool: SGLang
builds a hybrid SWA model's SWA host pool with the same ``build_kv_host_pool``, an MHA host pool).

Why not SGLang's own MHA class: ``pool_host/mha.py`` imports ``sglang.srt.mem_cache.memory_pool``,
which imports ``sglang.srt.configs``, which imports ``torchvision``; PyPI's torchvision wheels are
CUDA builds that cannot load beside the CPU torch these tests run on (``operator torchvision::nms
does not exist``). This pool keeps what the storage backend touches exactly as SGLang has it
(``pool_host/mha.py``): ``kv_buffer`` shaped ``(2, layers, tokens, heads, head_dim)`` for
``layer_first`` and ``(2, tokens, layers, heads, head_dim)`` for ``page_first``, and
``get_data_page(index, flat)`` slicing the same token range of it, so a page is a strided view of
the buffer (K and V planes, one run per layer for layer_first). ``MambaPoolHost`` needs neither, and
is built as it is.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import torch


class MHALayoutHostPool:
    """``pages`` host pages of ``page_size`` tokens, laid out like ``MHATokenToKVPoolHost``."""

    def __init__(
        self,
        pages: int,
        *,
        page_size: int,
        layout: str = "layer_first",
        layer_num: int = 2,
        head_num: int = 2,
        head_dim: int = 8,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.page_size = page_size
        self.layout = layout
        self.layer_num = layer_num
        self.head_num = head_num
        self.head_dim = head_dim
        self.dtype = dtype
        self.size = pages * page_size
        if layout == "layer_first":
            dims = (2, layer_num, self.size, head_num, head_dim)
        elif layout == "page_first":
            dims = (2, self.size, layer_num, head_num, head_dim)
        else:
            raise ValueError(f"layout {layout!r} is not modelled here")
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        """The page starting at token ``index`` (SGLang's slicing, a view unless ``flat``)."""
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index : index + self.page_size, :, :]
        else:
            page = self.kv_buffer[:, index : index + self.page_size, :, :, :]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        """A zeroed flat page to read into (what SGLang's file backend loads into)."""
        return torch.zeros(
            2 * self.layer_num * self.page_size * self.head_num * self.head_dim, dtype=self.dtype
        )

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        """Write a flat page (K then V, layer by layer) at token ``index``, as SGLang does."""
        if self.layout == "layer_first":
            shape: tuple[int, ...] = (2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        else:
            shape = (2, self.page_size, self.layer_num, self.head_num, self.head_dim)
        self.get_data_page(index, flat=False).copy_(data_page.reshape(shape))

    def indices(self, pages: list[int]) -> torch.Tensor:
        """The token indices of host ``pages``, as SGLang's controller passes them (int64)."""
        return torch.cat([torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages])

    def fill(self, page: int, seed: int) -> bytes:
        """Write seeded noise into host ``page``; returns its bytes."""
        gen = torch.Generator().manual_seed(seed)
        view = self.get_data_page(page * self.page_size, flat=False)
        noise = torch.randint(0, 256, (view.numel() * view.element_size(),), dtype=torch.uint8, generator=gen)
        view.copy_(noise.view(self.dtype).view(view.shape))
        return self.page_bytes(page)

    def page_bytes(self, page: int) -> bytes:
        """The bytes of host ``page`` (K then V, in SGLang's flat order)."""
        flat = self.get_data_page(page * self.page_size, flat=True)
        return bytes(flat.contiguous().view(torch.uint8).numpy())

    def wipe(self, page: int) -> None:
        """Zero host ``page``: SGLang dropped it from host memory."""
        self.get_data_page(page * self.page_size, flat=False).zero_()


def mamba_host_pool(
    slots: int,
    *,
    layers: int = 2,
    temporal_dtype: torch.dtype = torch.float32,
    conv_dtype: torch.dtype = torch.bfloat16,
) -> Any:
    """SGLang 0.5.23's own ``MambaPoolHost`` (``page_first``, on CPU, not pinned), with room for at
    least ``slots`` states: each a temporal (SSM) state of 4 × 8 and one conv state of 16 × 3 per layer.

    Built from the real class: ``pool_host/mamba.py`` imports only ``pool_host.base`` and
    ``pool_host.common`` of SGLang's host pools, but the package's ``__init__`` imports ``group.py``,
    which reaches ``torchvision`` through ``sglang.srt.configs`` (see the module docstring). So when
    that package cannot be imported, it is entered without its ``__init__`` (an empty package
    module over the same directory): every module then loaded is SGLang's own, unchanged.
    """
    try:
        import sglang.srt.mem_cache.pool_host  # noqa: F401
    except ImportError:
        import sglang.srt.mem_cache as mem_cache

        name = "sglang.srt.mem_cache.pool_host"
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(mem_cache.__path__[0], "pool_host")]
        sys.modules[name] = package
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    device = MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, 4, 8, dtype=temporal_dtype),
        conv=(torch.zeros(layers, slots, 16, 3, dtype=conv_dtype),),
    )
    return MambaPoolHost(
        device, 1.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first"
    )


def fill_state(pool: Any, slot: int, seed: int) -> bytes:
    """Write seeded noise into every state of Mamba ``slot``; returns the slot's page bytes."""
    gen = torch.Generator().manual_seed(seed)
    for buf in (pool.temporal_buffer, *pool.conv_buffer):
        view = buf[slot]
        noise = torch.randint(0, 256, (view.numel() * view.element_size(),), dtype=torch.uint8, generator=gen)
        view.copy_(noise.view(view.dtype).view(view.shape))
    return state_bytes(pool, slot)


def state_bytes(pool: Any, slot: int) -> bytes:
    """The bytes of Mamba ``slot`` in SGLang's flat page order (temporal, then conv)."""
    return bytes(pool.get_data_page(slot, flat=True).numpy())


def wipe_state(pool: Any, slot: int) -> None:
    """Zero Mamba ``slot``: SGLang dropped it from host memory."""
    for buf in (pool.temporal_buffer, *pool.conv_buffer):
        buf[slot].zero_()
