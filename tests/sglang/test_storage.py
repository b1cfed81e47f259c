"""tiercache as SGLang's HiCache storage backend, against the real SGLang package (0.5.23): its
``HiCacheStorage`` base, its dynamic ``StorageBackendFactory`` and failure injector, and a real
tiercache server in its own process. The host pool has SGLang's MHA memory layout (see hostpool)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed (CI runs these in .venv-sglang)"
)

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageFailureInjector

from tests.conftest import S3Endpoint
from tests.server.conftest import manifest as vllm_manifest
from tests.server.serverproc import ServerSpec
from tests.sglang.hostpool import MHALayoutHostPool
from tests.sglang.setup import PAGE, backend, keys, running, server_spec, storage_config
from tiercache.client.client import Client
from tiercache.errors import ConfigError
from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey
from tiercache.sglang import TierCacheStorage
from tiercache.sglang.keys import KV_GROUP, page_hash
from tiercache.testing.poll import wait_until

Make = Callable[..., HiCacheStorage]


@pytest.fixture
def make(request: pytest.FixtureRequest) -> Iterator[Make]:
    """Build backends through SGLang's factory; every one is closed at the end."""
    made: list[HiCacheStorage] = []

    def build(endpoint: str, pool: MHALayoutHostPool, **config: Any) -> HiCacheStorage:
        b = backend(endpoint, pool, **config)
        made.append(b)
        return b

    yield build
    for b in made:
        b.close()


def _store(b: HiCacheStorage, pool: MHALayoutHostPool, names: list[str], pages: list[int]) -> list[bytes]:
    data = [pool.fill(p, seed=1000 + p) for p in pages]
    assert b.batch_set_v1(names, pool.indices(pages)) == [True] * len(names)
    return data


def test_factory_loads_the_backend_and_pages_come_back_into_other_host_indices(
    tmp_path: Path, make: Make
) -> None:
    """Stored pages, dropped from host memory, load into other host pages with equal bytes."""
    with running(server_spec(tmp_path)) as server:
        pool = MHALayoutHostPool(16, page_size=PAGE)
        b = make(server.endpoint, pool)
        assert type(b) is TierCacheStorage
        names = keys(3)
        stored = _store(b, pool, names, [0, 1, 2])
        for p in (0, 1, 2):
            pool.wipe(p)
        assert b.batch_exists(names) == 3
        assert b.batch_get_v1(names, pool.indices([9, 5, 12])) == [True, True, True]
        assert [pool.page_bytes(p) for p in (9, 5, 12)] == stored
        assert pool.page_bytes(0) == bytes(len(stored[0]))  # the old places stay dropped


def test_page_first_layout_round_trips(tmp_path: Path, make: Make) -> None:
    """The page_first layout (one K and one V run per page) stores and loads byte for byte."""
    with running(server_spec(tmp_path, disk=False)) as server:
        pool = MHALayoutHostPool(8, page_size=PAGE, layout="page_first")
        b = make(server.endpoint, pool)
        names = keys(2)
        stored = _store(b, pool, names, [1, 2])
        assert b.batch_get_v1(names, pool.indices([6, 4])) == [True, True]
        assert [pool.page_bytes(p) for p in (6, 4)] == stored


def test_batch_exists_counts_only_the_leading_hits(tmp_path: Path, make: Make) -> None:
    """SGLang prefetches the run of hits from the first key: a gap ends it, later hits do not count."""
    with running(server_spec(tmp_path, disk=False)) as server:
        pool = MHALayoutHostPool(8, page_size=PAGE)
        b = make(server.endpoint, pool)
        names = keys(5)
        _store(b, pool, [names[0], names[1], names[3], names[4]], [0, 1, 3, 4])
        assert b.batch_exists(names) == 2
        assert b.batch_exists(names[2:]) == 0
        assert b.batch_exists(names[3:]) == 2
        assert b.exists(names[4]) and not b.exists(names[2])
        # A load stops at the same place: the pages after the gap are not written.
        pool.wipe(4)
        assert b.batch_get_v1(names, pool.indices([5, 6, 7, 2, 4])) == [True, True, False, False, False]
        assert pool.page_bytes(4) == bytes(len(pool.page_bytes(0)))


def test_two_tp_ranks_keep_their_own_pages(tmp_path: Path, make: Make) -> None:
    """Each TP rank holds other heads: the same page keys from two ranks are two objects."""
    with running(server_spec(tmp_path, disk=False)) as server:
        pools = [MHALayoutHostPool(4, page_size=PAGE) for _ in range(2)]
        ranks = [make(server.endpoint, pools[r], tp_rank=r, tp_size=2) for r in range(2)]
        names = keys(2)
        stored0 = [pools[0].fill(p, seed=p) for p in (0, 1)]
        assert ranks[0].batch_set_v1(names, pools[0].indices([0, 1])) == [True, True]
        assert ranks[1].batch_exists(names) == 0  # rank 0's pages are not rank 1's
        stored1 = [pools[1].fill(p, seed=50 + p) for p in (0, 1)]
        assert ranks[1].batch_set_v1(names, pools[1].indices([0, 1])) == [True, True]
        for r, stored in ((0, stored0), (1, stored1)):
            assert ranks[r].batch_get_v1(names, pools[r].indices([2, 3])) == [True, True]
            assert [pools[r].page_bytes(p) for p in (2, 3)] == stored


def _loaded_by_a_new_server(spec: ServerSpec, make: Make) -> int:
    """Store 3 pages through a server of ``spec``, stop it (a clean stop flushes the write-behind),
    then load them through a new one of the same ``spec`` (empty L1): exists, then the get into
    other host pages, bytes equal. How many objects the new server promoted."""
    names = keys(3)
    with running(spec) as server:
        pool = MHALayoutHostPool(8, page_size=PAGE)
        first = make(server.endpoint, pool)
        stored = _store(first, pool, names, [0, 1, 2])
        first.close()
    with running(spec) as server, Client(server.endpoint) as watcher:
        fresh = MHALayoutHostPool(8, page_size=PAGE)
        b = make(server.endpoint, fresh)
        assert b.batch_exists(names) == 3
        assert b.batch_get_v1(names, fresh.indices([3, 4, 5])) == [True, True, True]
        assert [fresh.page_bytes(p) for p in (3, 4, 5)] == stored
        return int(watcher.stats()["engine"]["promotions"])


def test_pages_survive_a_server_restart_on_disk(tmp_path: Path, make: Make) -> None:
    """A new server process (empty L1) on the same LMDB directory serves the pages from disk."""
    assert _loaded_by_a_new_server(server_spec(tmp_path), make) == 3


def test_pages_come_back_from_s3_into_a_new_server(tmp_path: Path, make: Make, s3: S3Endpoint) -> None:
    """Pages stored through a server with an S3 tier (moto's server over HTTP, no disk) load, byte
    for byte, through a new server on the same bucket: its L1 is empty, so the exists' lookup
    promotes them from S3 and the get copies them from its ticket."""
    assert _loaded_by_a_new_server(server_spec(tmp_path, disk=False, s3_url=s3.url), make) == 3


def test_a_page_damaged_on_disk_is_a_miss(tmp_path: Path, make: Make) -> None:
    """Bytes flipped inside LMDB's file: that page and the ones after it miss; none is loaded."""
    spec = server_spec(tmp_path)
    names = keys(3)
    with running(spec) as server:
        pool = MHALayoutHostPool(8, page_size=PAGE)
        b = make(server.endpoint, pool)
        stored = _store(b, pool, names, [0, 1, 2])
        b.close()
    mdb = next((tmp_path / "l2").rglob("data.mdb"))
    raw = bytearray(mdb.read_bytes())
    probe = stored[1][100:164]  # seeded noise: found only where page 1 is stored
    at = raw.find(probe)
    assert at >= 0, "the page's bytes are not stored verbatim in data.mdb"
    while at >= 0:
        raw[at : at + len(probe)] = bytes(x ^ 0xFF for x in probe)
        at = raw.find(probe, at + len(probe))
    mdb.write_bytes(bytes(raw))
    with running(spec) as server:
        fresh = MHALayoutHostPool(8, page_size=PAGE)
        b = make(server.endpoint, fresh)
        assert b.batch_get_v1(names, fresh.indices([3, 4, 5])) == [True, False, False]
        assert fresh.page_bytes(3) == stored[0]
        assert fresh.page_bytes(4) == bytes(len(stored[1]))  # nothing of the damaged page landed
        assert b.batch_exists(names) == 1  # the damaged object was deleted when it failed its check


def test_vllm_and_sglang_objects_never_meet(tmp_path: Path, make: Make) -> None:
    """A vLLM-layout client and the SGLang backend, on one server, under the very same prefix
    hashes: neither finds the other's objects, because the fingerprints differ."""
    with running(server_spec(tmp_path, disk=False)) as server:
        pool = MHALayoutHostPool(8, page_size=PAGE)
        b = make(server.endpoint, pool)
        names = keys(2)
        hashes = [page_hash(k) for k in names]
        with Client(server.endpoint) as vllm:
            refs = vllm.register(
                [(0, vllm_manifest(chunk_size=PAGE, kernel_block_size=PAGE, manager_block_size=PAGE))]
            )
            ours = [ObjectKey(b.fingerprint, 0, h) for h in hashes]  # type: ignore[attr-defined]
            assert refs[0].fingerprint != ours[0].fingerprint.raw
            theirs = [ObjectKey(Fingerprint(refs[0].fingerprint), 0, h) for h in hashes]
            assert vllm.store_chunks(theirs, [bytes(512)] * 2) == 2
            assert b.batch_exists(names) == 0
            assert b.batch_get_v1(names, pool.indices([0, 1])) == [False, False]
            _store(b, pool, names, [2, 3])
            assert b.batch_exists(names) == 2
            assert vllm.lookup(hashes, refs, prefetch=False).chunks == 2  # its own, not ours
            assert vllm.load_chunks(theirs) == [bytes(512)] * 2


def test_sglang_failure_injector_wraps_it_and_failures_are_misses(
    tmp_path: Path, make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's factory wraps the backend in its failure injector when asked; an injected failure is
    a miss or a failed store, and with no failure injected everything passes through."""
    with running(server_spec(tmp_path, disk=False)) as server:
        pool = MHALayoutHostPool(8, page_size=PAGE)
        monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "1.0")
        failing = make(server.endpoint, pool)
        assert isinstance(failing, HiCacheStorageFailureInjector)
        names = keys(2)
        pool.fill(0, 1)
        pool.fill(1, 2)
        assert failing.batch_set_v1(names, pool.indices([0, 1])) == [False, False]
        monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.0")
        passing = make(server.endpoint, pool)
        assert isinstance(passing, HiCacheStorageFailureInjector)
        stored = _store(passing, pool, names, [0, 1])
        assert failing.batch_exists(names) == 0
        assert failing.batch_get_v1(names, pool.indices([2, 3])) == [False, False]
        assert passing.batch_exists(names) == 2
        assert passing.batch_get_v1(names, pool.indices([2, 3])) == [True, True]
        assert [pool.page_bytes(p) for p in (2, 3)] == stored


def test_server_going_away_gives_counted_misses_then_reconnects(tmp_path: Path, make: Make) -> None:
    """With the server stopped, calls answer misses and failed stores (counted) instead of raising;
    a server back on the same socket is found again and serves what is on its disk."""
    spec = server_spec(tmp_path)
    names = keys(2)
    pool = MHALayoutHostPool(8, page_size=PAGE)
    with running(spec) as server:
        b = make(server.endpoint, pool, timeout_s=1.0, retry_s=0.2)
        stored = _store(b, pool, names, [0, 1])
    assert isinstance(b, TierCacheStorage)
    before = b.counters()
    assert b.batch_exists(names) == 0
    assert b.batch_get_v1(names, pool.indices([2, 3])) == [False, False]
    assert b.batch_set_v1(names, pool.indices([0, 1])) == [False, False]
    after = b.counters()
    assert after["unavailable"] >= before["unavailable"] + 2
    assert after["load_missed"] == before["load_missed"] + 2
    assert after["store_failed"] == before["store_failed"] + 2
    with running(spec):
        wait_until(lambda: b.batch_exists(names) == 2, timeout=30, what="the backend reconnected")
        assert b.batch_get_v1(names, pool.indices([4, 5])) == [True, True]
        assert [pool.page_bytes(p) for p in (4, 5)] == stored
        assert b.counters()["outages"] >= 1


def test_tensor_interface_without_zero_copy(tmp_path: Path, make: Make) -> None:
    """Without interface_v1 SGLang calls batch_set/batch_get with flat page tensors: same objects."""
    import torch

    with running(server_spec(tmp_path, disk=False)) as server:
        pool = MHALayoutHostPool(8, page_size=PAGE)
        b = make(server.endpoint, pool, interface_v1=0)
        names = keys(2)
        stored = [pool.fill(p, seed=p) for p in (0, 1)]
        assert b.batch_set(names, [pool.get_data_page(p * PAGE) for p in (0, 1)])
        targets = [torch.zeros_like(pool.get_data_page(0)) for _ in names]
        got = b.batch_get(names, targets)
        assert [bytes(t.view(torch.uint8).numpy()) for t in got] == stored
        assert b.get(keys(1, "absent")[0], torch.zeros_like(targets[0])) is None


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"timeout_s": "soon"}, "timeout_s='soon' is not a number of seconds"),
        ({"server": "localhost:5555"}, "is not a tiercache endpoint"),
        ({"overlap_loads": True}, "vLLM connector setting"),
        ({"tiercache.colour": "red"}, "unknown"),
    ],
)
def test_a_bad_setting_fails_the_start_naming_it(extra: dict[str, Any], says: str) -> None:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    pool = MHALayoutHostPool(2, page_size=PAGE)
    with pytest.raises(ConfigError, match=says) as err:
        StorageBackendFactory.create_backend("dynamic", storage_config("ipc:///nowhere", **extra), pool)
    assert "--hicache-storage-backend-extra-config" in str(err.value)


def test_a_page_size_that_is_not_the_servers_chunk_size_fails_the_start(tmp_path: Path, make: Make) -> None:
    with running(server_spec(tmp_path, disk=False)) as server:
        with pytest.raises(ConfigError, match=f"--page-size {PAGE}"):
            make(server.endpoint, MHALayoutHostPool(2, page_size=2 * PAGE))


def test_the_kv_pool_named_again_is_accepted(tmp_path: Path, make: Make) -> None:
    """SGLang's hybrid controller registers the KV pool a second time by name: the same pool passes
    (extra pools and refusals: test_hybrid)."""
    with running(server_spec(tmp_path, disk=False)) as server:
        pool = MHALayoutHostPool(4, page_size=PAGE)
        b = make(server.endpoint, pool)
        b.register_mem_host_pool_v2(pool, "kv")
        # Still the one KV pool: pages go out and come back through it as before.
        names = keys(1)
        stored = _store(b, pool, names, [0])
        assert b.batch_get_v1(names, pool.indices([3])) == [True]
        assert pool.page_bytes(3) == stored[0]


def test_engines_whose_pages_differ_never_share_them(tmp_path: Path, make: Make) -> None:
    """Same page keys, one server: another layout, dtype, model or weights is another fingerprint,
    so none of them finds the pages the first engine stored; an identical engine does."""
    import torch

    with running(server_spec(tmp_path, disk=False)) as server:
        pool = MHALayoutHostPool(4, page_size=PAGE)
        first = make(server.endpoint, pool)
        names = keys(2)
        _store(first, pool, names, [0, 1])
        others = {
            "page_first layout": make(
                server.endpoint, MHALayoutHostPool(4, page_size=PAGE, layout="page_first")
            ),
            "float16": make(server.endpoint, MHALayoutHostPool(4, page_size=PAGE, dtype=torch.float16)),
            "another model": make(server.endpoint, MHALayoutHostPool(4, page_size=PAGE), model="other/model"),
            "other weights": make(server.endpoint, MHALayoutHostPool(4, page_size=PAGE), weights_id="w2"),
        }
        assert {what: b.batch_exists(names) for what, b in others.items()} == dict.fromkeys(others, 0)
        twin = make(server.endpoint, MHALayoutHostPool(4, page_size=PAGE))
        assert twin.batch_exists(names) == 2


def test_a_page_another_client_scribbled_on_is_a_miss_never_its_bytes(tmp_path: Path, make: Make) -> None:
    """The arena is shared memory: a page whose slot another client wrote into (late, or outside
    its own slots) fails its digest after the copy, in a get that pins and in a get from the
    exists' ticket alike: that page and the ones after it are misses, and the server drops it."""
    with running(server_spec(tmp_path, disk=False)) as server, Client(server.endpoint) as other:
        pool = MHALayoutHostPool(8, page_size=PAGE)
        b = make(server.endpoint, pool)
        assert isinstance(b, TierCacheStorage)
        names = keys(3)
        stored = _store(b, pool, names, [0, 1, 2])
        fp = b.fingerprint
        assert fp is not None
        slots = other.pin([ObjectKey(fp, KV_GROUP, page_hash(n)) for n in names])
        other.release([s.token for s in slots if s is not None])
        assert slots[1] is not None
        other.arena().view(slots[1].offset + 16, 8)[:] = b"scribble"
        assert b.batch_exists(names) == 3  # the server does not read the bytes to answer
        assert b.batch_get_v1(names, pool.indices([5, 6, 7])) == [True, False, False]  # the ticket's
        assert pool.page_bytes(5) == stored[0]
        assert b.counters()["corrupt"] == 1
        wait_until(
            lambda: other.stats()["engine"]["integrity_failures_l1_read"] == 1,
            what="the server to count the page the backend reported",
        )
        # Dropped by the server: the pages after the first are misses now, for a pinning get too.
        assert b.batch_get_v1(names, pool.indices([5, 6, 7])) == [True, False, False]
