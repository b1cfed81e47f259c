"""A hybrid model's extra host pools through SGLang 0.5.23's v2 calls (``register_mem_host_pool_v2``,
``batch_set_v2``, ``batch_get_v2``, ``batch_exists_v2``), against a real tiercache server process.

As SGLang's ``HybridCacheController`` does it: the KV pool is registered as the host pool and then
again by name with the extra pools; KV pages move through the zero-copy v1 calls, the extra pools'
through v2 (``PoolTransfer`` per pool: its host indices and page keys). The Mamba pool is SGLang's own
``MambaPoolHost``; the KV and SWA pools have ``MHATokenToKVPoolHost``'s memory layout (SGLang's MHA
host pool cannot be imported on this CPU build; see hostpool). The hit policies are checked against
SGLang's own ``HiCacheFile.batch_exists_v2`` on the same pages: it is SGLang's definition of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed (CI runs these in .venv-sglang)"
)

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    HiCacheStorage,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from tests.sglang.hostpool import MHALayoutHostPool, fill_state, mamba_host_pool, state_bytes, wipe_state
from tests.sglang.setup import PAGE, backend, keys, running, server_spec, storage_config
from tiercache.errors import ConfigError
from tiercache.sglang import TierCacheStorage
from tiercache.sglang.storage import UnsupportedPoolError

#: Pages (and Mamba slots) each pool of a test has.
PAGES = 16


class Hybrid:
    """One engine's host pools (KV, SWA, Mamba) and a backend they are registered with."""

    def __init__(self, endpoint: str, **config: Any) -> None:
        self.kv = MHALayoutHostPool(PAGES, page_size=PAGE)
        # The SWA pool laid out exactly as the KV pool: only the pool's name tells their pages apart.
        self.swa = MHALayoutHostPool(PAGES, page_size=PAGE)
        self.mamba = mamba_host_pool(PAGES, **config.pop("mamba", {}))
        self.backend: HiCacheStorage = backend(endpoint, self.kv, **config)
        for name, pool in ((PoolName.KV, self.kv), (PoolName.SWA, self.swa), (PoolName.MAMBA, self.mamba)):
            self.backend.register_mem_host_pool_v2(pool, name)
        self.backend.on_host_pools_registered()

    def swa_transfer(self, names: list[str], pages: list[int], **kw: Any) -> PoolTransfer:
        return PoolTransfer(name=PoolName.SWA, host_indices=self.swa.indices(pages), keys=names, **kw)

    def mamba_transfer(self, names: list[str], slots: list[int], **kw: Any) -> PoolTransfer:
        # A Mamba pool's page is one slot (page_size 1): one host index per key.
        return PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor(slots), keys=names, **kw)


@pytest.fixture
def hybrids() -> Iterator[list[Hybrid]]:
    made: list[Hybrid] = []
    yield made
    for h in made:
        h.backend.close()


def test_kv_swa_and_mamba_pages_come_back_into_other_host_indices(
    tmp_path: Path, hybrids: list[Hybrid]
) -> None:
    """KV pages (v1), SWA pages and Mamba states (one batch_set_v2 for both), dropped from host
    memory and loaded into other host indices, come back byte for byte."""
    with running(server_spec(tmp_path, disk=False)) as server:
        h = Hybrid(server.endpoint)
        hybrids.append(h)
        b = h.backend
        names = keys(3)
        kv = [h.kv.fill(p, seed=10 + p) for p in (0, 1, 2)]
        swa = [h.swa.fill(p, seed=20 + p) for p in (1, 2)]
        states = [fill_state(h.mamba, s, seed=30 + s) for s in (3,)]
        assert b.batch_set_v1(names, h.kv.indices([0, 1, 2])) == [True] * 3
        done = b.batch_set_v2([h.swa_transfer(names[1:], [1, 2]), h.mamba_transfer(names[2:], [3])])
        assert done == {PoolName.SWA: [True, True], PoolName.MAMBA: [True]}
        for p in (0, 1, 2):
            h.kv.wipe(p)
            h.swa.wipe(p)
        wipe_state(h.mamba, 3)

        assert b.batch_get_v1(names, h.kv.indices([9, 5, 12])) == [True] * 3
        got = b.batch_get_v2([h.swa_transfer(names[1:], [7, 4]), h.mamba_transfer(names[2:], [11])])
        assert got == {PoolName.SWA: [True, True], PoolName.MAMBA: [True]}
        assert [h.kv.page_bytes(p) for p in (9, 5, 12)] == kv
        assert [h.swa.page_bytes(p) for p in (7, 4)] == swa
        assert state_bytes(h.mamba, 11) == states[0]
        assert state_bytes(h.mamba, 3) == bytes(len(states[0]))  # the old place stays dropped


def test_extra_pool_pages_are_objects_of_their_own(tmp_path: Path, hybrids: list[Hybrid]) -> None:
    """Under the very same SGLang page keys, a KV page, an SWA page and a Mamba state are three
    objects: storing one makes neither other exist, and each pool has its own fingerprint (the SWA
    pool has the KV pool's very layout). An engine whose Mamba states differ only in a state's dtype
    (float16 conv states, the same bytes) never finds the first engine's states."""
    with running(server_spec(tmp_path, disk=False)) as server:
        h = Hybrid(server.endpoint)
        hybrids.append(h)
        b = h.backend
        assert isinstance(b, TierCacheStorage)
        prints = {name: b.pool_fingerprint(name) for name in ("kv", "swa", "mamba")}
        assert None not in prints.values() and len(set(prints.values())) == 3
        names = keys(2)
        fill_state(h.mamba, 0, seed=1)
        fill_state(h.mamba, 1, seed=2)
        assert b.batch_set_v2([h.mamba_transfer(names, [0, 1])]) == {PoolName.MAMBA: [True, True]}
        assert b.batch_exists(names) == 0  # no KV page came of it
        assert b.batch_get_v1(names, h.kv.indices([3, 4])) == [False, False]
        assert b.batch_get_v2([h.swa_transfer(names, [3, 4])]) == {PoolName.SWA: [False, False]}
        h.swa.fill(5, seed=3)
        assert b.batch_set_v2([h.swa_transfer(names[:1], [5])]) == {PoolName.SWA: [True]}
        assert b.batch_get_v2([h.mamba_transfer(names, [6, 7])]) == {PoolName.MAMBA: [True, True]}

        other = Hybrid(server.endpoint, mamba={"conv_dtype": torch.float16})
        hybrids.append(other)
        assert isinstance(other.backend, TierCacheStorage)
        assert other.backend.pool_fingerprint("mamba") != prints["mamba"]
        assert other.backend.pool_fingerprint("kv") == prints["kv"]  # the KV pools are alike
        assert other.backend.batch_get_v2([other.mamba_transfer(names, [0, 1])]) == {
            PoolName.MAMBA: [False, False]
        }
        twin = Hybrid(server.endpoint)
        hybrids.append(twin)
        assert twin.backend.batch_get_v2([twin.mamba_transfer(names, [0, 1])]) == {
            PoolName.MAMBA: [True, True]
        }
        assert [state_bytes(twin.mamba, s) for s in (0, 1)] == [state_bytes(h.mamba, s) for s in (0, 1)]


def _result(r: PoolTransferResult) -> tuple[int, dict[str, int], list[int]]:
    return (
        r.kv_hit_pages,
        {str(k): v for k, v in r.extra_pool_hit_pages.items()},
        list(r.restorable_prefix_pages or []),
    )


# (KV pages stored, SWA pages stored, Mamba states stored, each pool's hit policy and window)
PATTERNS = [
    pytest.param([0, 1, 2, 3, 4], [0, 1, 3], [], [("swa", PoolHitPolicy.ALL_PAGES, 5)], id="all_pages-gap"),
    pytest.param(
        [0, 1, 2], [0, 1, 2, 3], [], [("swa", PoolHitPolicy.ALL_PAGES, 3)], id="all_pages-kv-shorter"
    ),
    pytest.param(
        [0, 1, 2, 3, 4, 5], [], [1, 4], [("mamba", PoolHitPolicy.TRAILING_PAGES, 1)], id="trailing-mamba"
    ),
    pytest.param(
        [0, 1, 2, 3, 4, 5], [2, 3, 5], [], [("swa", PoolHitPolicy.TRAILING_PAGES, 2)], id="trailing-swa-2"
    ),
    pytest.param(
        [0, 1, 2, 3], [], [3, 5], [("mamba", PoolHitPolicy.TRAILING_PAGES, 1)], id="trailing-past-kv"
    ),
    pytest.param(
        [0, 1, 2, 3, 4, 5],
        [1, 2, 3, 4],
        [2, 4],
        [("swa", PoolHitPolicy.TRAILING_PAGES, 2), ("mamba", PoolHitPolicy.TRAILING_PAGES, 1)],
        id="trailing-swa-and-mamba",
    ),
    pytest.param(
        [0, 1, 2, 3, 4, 5],
        [0, 1, 2, 3],
        [1, 3, 5],
        [("swa", PoolHitPolicy.ALL_PAGES, 6), ("mamba", PoolHitPolicy.TRAILING_PAGES, 1)],
        id="all-and-trailing",
    ),
    pytest.param([], [0, 1], [0, 1], [("mamba", PoolHitPolicy.TRAILING_PAGES, 1)], id="no-kv"),
]


@pytest.mark.parametrize(("kv_pages", "swa_pages", "states", "policies"), PATTERNS)
def test_batch_exists_v2_applies_the_hit_policies_as_sglang_does(
    tmp_path: Path,
    hybrids: list[Hybrid],
    kv_pages: list[int],
    swa_pages: list[int],
    states: list[int],
    policies: list[tuple[str, PoolHitPolicy, int]],
) -> None:
    """The same pages stored in tiercache and in SGLang's HiCacheFile: batch_exists_v2 answers the
    same usable prefix, each pool's own hits and the same restorable prefixes (ALL_PAGES: every page
    below the prefix; TRAILING_PAGES: only the last ``len(keys)`` pages of it)."""
    names = keys(6)
    with running(server_spec(tmp_path, disk=False)) as server:
        h = Hybrid(server.endpoint)
        hybrids.append(h)
        cfg = storage_config("ipc:///unused")
        cfg.extra_config = {"file_storage_path": str(tmp_path / "hicache-file")}
        oracle = HiCacheFile(cfg)
        for name, pool in ((PoolName.KV, h.kv), (PoolName.SWA, h.swa), (PoolName.MAMBA, h.mamba)):
            oracle.register_mem_host_pool_v2(pool, name)
        for store in (h.backend, oracle):
            for p in kv_pages:
                h.kv.fill(p, seed=p)
                transfer = PoolTransfer(name=PoolName.KV, host_indices=h.kv.indices([p]), keys=[names[p]])
                if store is oracle:
                    assert store.batch_set_v2([transfer]) == {PoolName.KV: [True]}
                else:
                    assert store.batch_set_v1([names[p]], h.kv.indices([p])) == [True]
            for p in swa_pages:
                assert store.batch_set_v2([h.swa_transfer([names[p]], [p])]) == {PoolName.SWA: [True]}
            for s in states:
                assert store.batch_set_v2([h.mamba_transfer([names[s]], [s])]) == {PoolName.MAMBA: [True]}

        def ask(store: HiCacheStorage) -> tuple[int, dict[str, int], list[int]]:
            transfers = [
                PoolTransfer(name=PoolName(name), keys=names[:window], hit_policy=policy)
                for name, policy, window in policies
            ]
            return _result(store.batch_exists_v2(names, transfers))

        ours, sglangs = ask(h.backend), ask(oracle)
        assert ours == sglangs
        assert ours[0] == (ours[2][-1] if ours[2] else 0)


def test_pools_are_registered_again_after_a_server_restart(tmp_path: Path, hybrids: list[Hybrid]) -> None:
    """A new server process on the same LMDB directory: the backend registers every pool again on
    reconnecting, and the Mamba states on disk load."""
    spec = server_spec(tmp_path)
    names = keys(2)
    with running(spec) as server:
        h = Hybrid(server.endpoint, timeout_s=1.0, retry_s=0.2)
        hybrids.append(h)
        stored = [fill_state(h.mamba, s, seed=s) for s in (0, 1)]
        assert h.backend.batch_set_v2([h.mamba_transfer(names, [0, 1])]) == {PoolName.MAMBA: [True, True]}
    with running(spec):
        from tiercache.testing.poll import wait_until

        def loaded() -> bool:
            got = h.backend.batch_get_v2([h.mamba_transfer(names, [5, 6])])
            return got == {PoolName.MAMBA: [True, True]}

        wait_until(loaded, timeout=30, what="the Mamba states loaded after the restart")
        assert [state_bytes(h.mamba, s) for s in (5, 6)] == stored


@pytest.mark.parametrize("name", [PoolName.INDEXER, PoolName.DEEPSEEK_V4_C4, PoolName.DRAFT])
def test_an_unsupported_pool_kind_is_refused_at_start(tmp_path: Path, name: PoolName) -> None:
    """A pool this backend does not store fails SGLang's start, naming the pool and what to do."""
    with running(server_spec(tmp_path, disk=False)) as server:
        kv = MHALayoutHostPool(2, page_size=PAGE)
        b = backend(server.endpoint, kv)
        try:
            b.register_mem_host_pool_v2(kv, PoolName.KV)
            with pytest.raises(UnsupportedPoolError, match=f"'{name.value}'.*--hicache-storage-backend"):
                b.register_mem_host_pool_v2(MHALayoutHostPool(2, page_size=PAGE), name)
        finally:
            b.close()


def test_a_pool_whose_pages_cannot_be_read_is_refused(tmp_path: Path) -> None:
    """An SWA pool that is neither page views of one tensor nor SGLang's flat-page calls, and an
    SWA pool of another page size than the KV pool's, are refused; so is a second KV pool."""

    class Opaque:
        page_size = PAGE
        layout = "layer_first"

        def __init__(self) -> None:
            self.kv_buffer = [torch.zeros(4)]

    with running(server_spec(tmp_path, disk=False)) as server:
        kv = MHALayoutHostPool(2, page_size=PAGE)
        b = backend(server.endpoint, kv)
        try:
            assert issubclass(UnsupportedPoolError, ConfigError)
            with pytest.raises(UnsupportedPoolError, match="neither page views"):
                b.register_mem_host_pool_v2(Opaque(), PoolName.SWA)
            with pytest.raises(UnsupportedPoolError, match=f"pages of {2 * PAGE} tokens"):
                b.register_mem_host_pool_v2(MHALayoutHostPool(2, page_size=2 * PAGE), PoolName.SWA)
            with pytest.raises(UnsupportedPoolError, match="'kv'"):
                b.register_mem_host_pool_v2(MHALayoutHostPool(2, page_size=PAGE), PoolName.KV)
        finally:
            b.close()
