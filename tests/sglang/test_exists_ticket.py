"""SGLang's prefetch asks ``batch_exists`` and then ``batch_get_v1`` for the same pages: the get
copies from the slots the exists' lookup pinned, with no pin of its own, and never trusts a copy
that may have outlived those pins (:mod:`tiercache.sglang.held`). Against the real SGLang package
and a real server process."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed (CI runs these in .venv-sglang)"
)

from tests.sglang.hostpool import MHALayoutHostPool
from tests.sglang.setup import PAGE, backend, keys, running, server_spec
from tiercache.client.client import Client
from tiercache.client.transfer import Window
from tiercache.sglang import TierCacheStorage
from tiercache.sglang.held import ARENA_SHARE, MAX_HELD
from tiercache.testing.poll import wait_until

#: A lease window of 0.4 s: a held ticket is too old for a copy after 0.1 s.
SHORT_TTL_S = 0.4


class Spied:
    """A backend whose real client counts its pin calls."""

    def __init__(self, b: TierCacheStorage) -> None:
        self.b = b
        assert b._link is not None
        client = b._link.client()
        assert client is not None
        self.client = client
        self.pins = 0
        real = client.pin

        def pin(*args: Any, **kw: Any) -> Any:
            self.pins += 1
            return real(*args, **kw)

        client.pin = pin  # type: ignore[method-assign]


@pytest.fixture
def made() -> Iterator[list[TierCacheStorage]]:
    backends: list[TierCacheStorage] = []
    yield backends
    for b in backends:
        b.close()


def _backend(endpoint: str, pool: MHALayoutHostPool, made: list[TierCacheStorage]) -> Spied:
    b = backend(endpoint, pool)
    assert isinstance(b, TierCacheStorage)
    made.append(b)
    return Spied(b)


def _stored(s: Spied, pool: MHALayoutHostPool, names: list[str]) -> list[bytes]:
    data = [pool.fill(p, seed=300 + p) for p in range(len(names))]
    assert s.b.batch_set_v1(names, pool.indices(list(range(len(names))))) == [True] * len(names)
    return data


def _server(client: Client) -> dict[str, Any]:
    stats = client.stats()
    return {"l1_hits": stats["tiers"]["l1"]["hits"], **stats["server"]}


def test_a_get_after_its_batch_exists_copies_from_the_exists_ticket_with_no_pin(
    tmp_path: Path, made: list[TierCacheStorage]
) -> None:
    """The pages come back byte for byte, the get makes no pin, L1 counts one hit per page (the
    ticket is released as read) and no ticket or lease is left behind."""
    with running(server_spec(tmp_path, disk=False)) as server, Client(server.endpoint) as watcher:
        pool = MHALayoutHostPool(8, page_size=PAGE)
        s = _backend(server.endpoint, pool, made)
        names = keys(3)
        stored = _stored(s, pool, names)
        before = _server(watcher)
        assert s.b.batch_exists(names) == 3
        assert s.b.batch_get_v1(names, pool.indices([5, 7, 4])) == [True] * 3
        assert [pool.page_bytes(p) for p in (5, 7, 4)] == stored
        assert s.pins == 0
        wait_until(lambda: _server(watcher)["tickets"] == 0, timeout=10, what="the ticket's release")
        after = _server(watcher)
        assert after["l1_hits"] == before["l1_hits"] + 3
        assert after["leases"] == 0


def test_a_get_of_fewer_leading_pages_uses_the_ticket_and_any_other_get_pins(
    tmp_path: Path, made: list[TierCacheStorage]
) -> None:
    """SGLang's TP ranks may agree on fewer pages than one rank found: a get of the leading pages
    uses the ticket; a get that does not start where the exists started pins by key."""
    with running(server_spec(tmp_path, disk=False)) as server:
        pool = MHALayoutHostPool(8, page_size=PAGE)
        s = _backend(server.endpoint, pool, made)
        names = keys(3)
        stored = _stored(s, pool, names)
        assert s.b.batch_exists(names) == 3
        assert s.b.batch_get_v1(names[:2], pool.indices([5, 6])) == [True, True]
        assert s.pins == 0
        assert s.b.batch_exists(names) == 3
        assert s.b.batch_get_v1(names[1:], pool.indices([4, 7])) == [True, True]
        assert s.pins == 1
        assert [pool.page_bytes(p) for p in (5, 6, 4, 7)] == stored[:2] + stored[1:]


def test_a_copy_that_may_have_outlived_the_tickets_leases_is_all_misses(
    tmp_path: Path, made: list[TierCacheStorage], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy from the ticket's slots that ended after half the lease window (since the lookup was
    sent) may have read a slot the server reused: every page is a miss, none counted as read."""
    with running(server_spec(tmp_path, disk=False)) as server, Client(server.endpoint) as watcher:
        pool = MHALayoutHostPool(8, page_size=PAGE)
        s = _backend(server.endpoint, pool, made)
        names = keys(3)
        _stored(s, pool, names)
        before = _server(watcher)
        assert s.b.batch_exists(names) == 3
        # Every copy "ends" past half the window: the leases may have ended meanwhile.
        monkeypatch.setattr(Window, "held", lambda self, now=None: False)
        assert s.b.batch_get_v1(names, pool.indices([5, 6, 7])) == [False] * 3
        assert s.pins == 0  # no second try: SGLang recomputes those pages
        assert s.b.counters()["load_missed"] == 3
        wait_until(lambda: _server(watcher)["tickets"] == 0, timeout=10, what="the ticket's release")
        assert _server(watcher)["l1_hits"] == before["l1_hits"]


def test_a_ticket_too_old_for_a_copy_is_released_and_the_get_pins(
    tmp_path: Path, made: list[TierCacheStorage]
) -> None:
    """Past a quarter of the lease window after the exists, a copy from its ticket could outlive
    the leases: the get releases the ticket and pins the pages itself."""
    spec = server_spec(tmp_path, disk=False, l1_lease_ttl_s=SHORT_TTL_S)
    with running(spec) as server, Client(server.endpoint) as watcher:
        pool = MHALayoutHostPool(8, page_size=PAGE)
        s = _backend(server.endpoint, pool, made)
        names = keys(3)
        stored = _stored(s, pool, names)
        assert s.b.batch_exists(names) == 3
        time.sleep(2 * Window.START * SHORT_TTL_S)
        assert s.b.batch_get_v1(names, pool.indices([5, 6, 7])) == [True] * 3
        assert s.pins == 1
        assert [pool.page_bytes(p) for p in (5, 6, 7)] == stored
        wait_until(lambda: _server(watcher)["tickets"] == 0, timeout=10, what="the old ticket's release")


def test_tickets_no_get_takes_are_released_and_at_most_a_few_are_held(
    tmp_path: Path, made: list[TierCacheStorage]
) -> None:
    """SGLang revokes prefetches whose hits are too few, and never gets them: their tickets go at
    the next call once too old for a copy, and never more than MAX_HELD are held at once."""
    spec = server_spec(tmp_path, disk=False, l1_lease_ttl_s=SHORT_TTL_S)
    with running(spec) as server, Client(server.endpoint) as watcher:
        pool = MHALayoutHostPool(MAX_HELD + 2, page_size=PAGE)
        s = _backend(server.endpoint, pool, made)
        names = keys(MAX_HELD + 2)
        _stored(s, pool, names)
        for name in names:  # one ticket per first key
            assert s.b.batch_exists([name]) == 1
        wait_until(
            lambda: _server(watcher)["tickets"] == MAX_HELD, timeout=10, what="the oldest tickets' release"
        )
        time.sleep(2 * Window.START * SHORT_TTL_S)
        assert s.b.batch_exists(names[:1]) == 1  # releases every stale ticket, holds its own
        wait_until(lambda: _server(watcher)["tickets"] == 1, timeout=10, what="the stale tickets' release")
        s.b.close()
        wait_until(lambda: _server(watcher)["tickets"] == 0, timeout=10, what="the release at close")


def test_held_tickets_never_pin_more_than_their_share_of_the_arena(
    tmp_path: Path, made: list[TierCacheStorage]
) -> None:
    """Held tickets leave room for the stores: an exists that would pin more than an eighth of the
    arena holds nothing (its get pins by key), and the oldest held ticket goes to make room."""
    with running(server_spec(tmp_path, disk=False)) as server, Client(server.endpoint) as watcher:
        pool = MHALayoutHostPool(24, page_size=PAGE, layer_num=4, head_num=8, head_dim=128)  # 64 KiB pages
        s = _backend(server.endpoint, pool, made)
        share = int(s.client.arena().size * ARENA_SHARE) // len(pool.page_bytes(0))  # pages: 16
        names = keys(share + 4)
        stored = _stored(s, pool, names)
        assert s.b.batch_exists(names) == share + 4
        wait_until(
            lambda: _server(watcher)["tickets"] == 0, timeout=10, what="the too-large ticket's release"
        )
        assert s.b.batch_get_v1(names[:2], pool.indices([22, 23])) == [True, True]
        assert s.pins == 1 and [pool.page_bytes(p) for p in (22, 23)] == stored[:2]
        half = share // 2 + 1
        assert s.b.batch_exists(names[:half]) == half
        assert s.b.batch_exists(names[half : 2 * half]) == half
        wait_until(lambda: _server(watcher)["tickets"] == 1, timeout=10, what="the oldest ticket's release")
        assert s.b.batch_get_v1(names[half : half + 2], pool.indices([22, 23])) == [True, True]
        assert s.pins == 1  # the newer ticket was kept
