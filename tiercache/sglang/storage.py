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

The backend is split by what it does: page layout (:mod:`tiercache.sglang.pools`), the shared state,
set-up and plumbing (:mod:`tiercache.sglang.backend`), and the store, load and exists paths
(:mod:`tiercache.sglang.stores`, :mod:`tiercache.sglang.loads`, :mod:`tiercache.sglang.exists`);
this module joins them into the class SGLang loads.
"""

from __future__ import annotations

from tiercache.sglang.backend import StorageCounts
from tiercache.sglang.exists import ExistsPath
from tiercache.sglang.loads import LoadPath
from tiercache.sglang.pools import SUPPORTED_POOLS, UnsupportedPoolError
from tiercache.sglang.stores import StorePath

# Names importers had from this module before its split stay here.
__all__ = ["SUPPORTED_POOLS", "StorageCounts", "TierCacheStorage", "UnsupportedPoolError"]


class TierCacheStorage(ExistsPath, LoadPath, StorePath):
    """SGLang HiCache storage backed by a tiercache server (see the module docstring).

    SGLang's dynamic factory builds it as ``TierCacheStorage(storage_config, kwargs)``; the settings
    come from ``storage_config.extra_config`` (:mod:`tiercache.sglang.settings`) and a bad value fails
    the construction with :class:`ConfigError`. The server is reached when SGLang registers its host
    pool: a server that is not there yet is retried in the background (misses meanwhile); one that
    does not fit this engine (chunk size) fails the start-up. A hybrid model's extra pools (SWA,
    Mamba) come through ``register_mem_host_pool_v2``; one this backend cannot store fails the start
    with :class:`UnsupportedPoolError`.
    """
