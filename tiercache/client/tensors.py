"""torch views for the data path: the arena as a tensor, and digests of tensors in host memory.

For engine adapters whose pages are torch tensors (the vLLM connector, the SGLang backend); torch is
imported by this module only, so :mod:`tiercache.client` stays importable without it.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from tiercache.keys.digest import Digest
from tiercache.l1.arena import SharedArena


def arena_bytes(arena: SharedArena, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
    """A writable uint8 tensor over arena bytes ``[offset, offset + nbytes)`` (the whole arena by
    default; no copy)."""
    size = arena.size - offset if nbytes is None else nbytes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer on a writable mmap is fine
        return torch.frombuffer(arena.view(offset, size), dtype=torch.uint8)


def feed(digest: Digest, t: torch.Tensor) -> None:
    """Feed the bytes of host tensor ``t`` into ``digest``, in C order of its shape (what a copy
    of ``t`` into a contiguous buffer would hold), without copying: one piece per contiguous run.
    For a writer's digest over its own memory (:class:`~tiercache.client.transfer.Store`)."""
    if t.device.type != "cpu":
        raise ValueError(f"a digest reads host memory; this tensor is on {t.device}")
    if t.is_contiguous():
        if t.numel():
            digest.update(t.reshape(-1).view(torch.uint8).numpy())
    elif t.dim() > 1 and t.stride(-1) == 1:
        feed_array(digest, t.view(torch.uint8).numpy())
    else:  # elements strided in memory: one small copy beats hashing them one by one
        digest.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def feed_array(digest: Digest, a: np.ndarray) -> None:
    """:func:`feed` for a numpy array (any dtype, any strides), in C order of its shape."""
    if a.flags.c_contiguous:
        if a.size:
            digest.update(a)
    elif a.ndim > 1:
        for sub in a:
            feed_array(digest, sub)
    else:
        digest.update(np.ascontiguousarray(a))
