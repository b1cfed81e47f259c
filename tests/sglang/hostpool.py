"""A host KV pool with the memory layout of SGLang 0.5.23's ``MHATokenToKVPoolHost``.

Why not SGLang's own class: ``sglang.srt.mem_cache.pool_host`` imports ``sglang.srt.configs``, which
imports ``torchvision``; PyPI's torchvision wheels are CUDA builds that cannot load beside the CPU
torch these tests run on (``operator torchvision::nms does not exist``). This pool keeps what the
storage backend touches exactly as SGLang has it (``pool_host/mha.py``): ``kv_buffer`` shaped
``(2, layers, tokens, heads, head_dim)`` for ``layer_first`` and ``(2, tokens, layers, heads,
head_dim)`` for ``page_first``, and ``get_data_page(index, flat)`` slicing the same token range of
it, so a page is a strided view of the buffer (K and V planes, one run per layer for layer_first).
"""

from __future__ import annotations

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
