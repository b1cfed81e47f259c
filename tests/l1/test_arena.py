"""The shared arena: owner-only, attachable by name from another process, gone after unlink."""

from __future__ import annotations

import multiprocessing
import os
import signal
import stat
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import FakeClock, make_key, payload_for
from tiercache.config import L1Config
from tiercache.errors import ArenaError
from tiercache.l1.arena import SHM_DIR, SharedArena, default_arena_name
from tiercache.l1.tier import L1Tier
from tiercache.testing.poll import wait_until


# -- run in a spawned child process (module level so that spawn can import them) -------------------
def _child_read(name: str, offset: int, nbytes: int) -> bytes:
    arena = SharedArena.attach(name)
    try:
        return bytes(arena.view(offset, nbytes))
    finally:
        arena.close()


def _child_write(name: str, offset: int, data: bytes) -> None:
    arena = SharedArena.attach(name)
    try:
        arena.view(offset, len(data))[:] = data
    finally:
        arena.close()


@pytest.fixture
def spawn_pool():
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


# -- the arena on its own ----------------------------------------------------------------------------
def test_the_arena_file_is_owner_only() -> None:
    with SharedArena.create(default_arena_name(), 8192) as arena:
        mode = stat.S_IMODE(os.stat(arena.path).st_mode)
        assert mode == 0o600


def test_closing_and_unlinking_leaves_nothing_in_dev_shm() -> None:
    arena = SharedArena.create(default_arena_name(), 8192)
    path = arena.path
    assert path.exists()
    arena.close()
    arena.unlink()
    assert not path.exists()
    arena.unlink()  # idempotent


def test_an_l1_tier_unlinks_the_arena_it_created_at_close(clock: FakeClock) -> None:
    tier = L1Tier(L1Config(size_bytes=65536, name=default_arena_name()), clock=clock)
    path = SHM_DIR / tier.arena_name
    assert path.exists()
    tier.close()
    assert not path.exists()
    tier.close()  # idempotent


def test_an_l1_tier_leaves_a_passed_in_arena_to_its_owner(clock: FakeClock) -> None:
    with SharedArena.create(default_arena_name(), 65536) as arena:
        tier = L1Tier(L1Config(size_bytes=65536), clock=clock, arena=arena)
        assert tier.arena_name == arena.name
        tier.close()
        assert arena.path.exists()
    assert not arena.path.exists()


def test_writes_through_one_mapping_are_seen_through_another() -> None:
    with SharedArena.create(default_arena_name(), 8192) as owner:
        other = SharedArena.attach(owner.name)
        try:
            assert other.size == owner.size
            owner.view(100, 5)[:] = b"hello"
            assert bytes(other.view(100, 5)) == b"hello"
        finally:
            other.close()


def _mapped_kib(arena: SharedArena) -> int:
    """KiB of ``arena`` that this process's page tables map now (its mapping's Rss in smaps)."""
    rss, ours = 0, False
    for line in (Path("/proc/self/smaps")).read_text().splitlines():
        if line[:1] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
            ours = line.rstrip().endswith(str(arena.path))  # a mapping's header line
        elif ours and line.startswith("Rss:"):
            rss += int(line.split()[1])
    return rss


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc/<pid>/smaps")
def test_populate_maps_every_page_ahead_of_the_first_copy_and_changes_no_byte() -> None:
    size = 4 << 20
    with SharedArena.create(default_arena_name(), size) as owner:
        owner.view(size - 5, 5)[:] = b"hello"
        other = SharedArena.attach(owner.name)
        try:
            assert _mapped_kib(other) < 64  # a fresh mapping maps a page at its first access
            assert other.populate(step=1 << 20)
            assert _mapped_kib(other) >= size // 1024
            assert bytes(other.view(size - 5, 5)) == b"hello"
            assert bytes(other.view(0, 4096)) == bytes(4096)
        finally:
            other.close()


def test_populate_stops_once_the_arena_is_closed() -> None:
    with SharedArena.create(default_arena_name(), 1 << 20) as owner:
        other = SharedArena.attach(owner.name)
        other.close()
        assert not other.populate()
        outcome: list[tuple[bool, float]] = []
        owner.populate_in_background(lambda done, seconds: outcome.append((done, seconds))).join(timeout=30)
        assert outcome and outcome[0][0]


def test_creating_an_existing_name_is_refused() -> None:
    with SharedArena.create(default_arena_name(), 4096) as arena:
        with pytest.raises(ArenaError, match=r"already exists .* its server is running"):
            SharedArena.create(arena.name, 4096)


def _child_create_and_hang(name: str, ready: str) -> None:
    SharedArena.create(name, 4096)
    Path(ready).touch()
    time.sleep(600)


def test_a_fixed_name_left_by_a_killed_server_is_taken_over_by_the_next(tmp_path: Path) -> None:
    """A server started with --l1-name and killed with SIGKILL cannot unlink its arena; the next
    one with that name finds no process holding the arena's lock and starts anew (it could not,
    before: "already exists", until someone removed the file by hand)."""
    name = default_arena_name()
    ready = tmp_path / "ready"
    child = multiprocessing.get_context("spawn").Process(
        target=_child_create_and_hang, args=(name, str(ready))
    )
    child.start()
    try:
        wait_until(ready.exists, timeout=60, what="the first owner to create the arena")
        with pytest.raises(ArenaError, match="its server is running"):
            SharedArena.create(name, 4096)  # alive: refused
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join(30)
        assert (SHM_DIR / name).exists()  # left behind
        with SharedArena.create(name, 8192) as arena:
            assert arena.size == 8192
    finally:
        if child.is_alive():
            child.kill()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a file of another user")
def test_an_arena_of_another_user_is_never_attached() -> None:
    """A client maps only its own user's arena: another local user's (a squatted endpoint's) would
    read and take its stores."""
    with SharedArena.create(default_arena_name(), 4096) as arena:
        os.chown(arena.path, 12345, 12345)
        with pytest.raises(ArenaError, match="belongs to uid 12345"):
            SharedArena.attach(arena.name)


def test_an_arena_other_users_may_open_is_never_attached() -> None:
    """A server makes its arena 0600; one open to others may hold, or take, anyone's bytes."""
    with SharedArena.create(default_arena_name(), 4096) as arena:
        SharedArena.attach(arena.name).close()
        os.chmod(arena.path, 0o666)
        with pytest.raises(ArenaError, match="has mode 666, open to other users"):
            SharedArena.attach(arena.name)


def test_attaching_a_missing_arena_says_what_to_check() -> None:
    with pytest.raises(ArenaError, match=r"no L1 arena named .* is the tiercache server running"):
        SharedArena.attach(default_arena_name())


@pytest.mark.parametrize("bad", ["", "a/b", "../etc", ".hidden", "sp ace", "x" * 300])
def test_invalid_names_are_refused(bad: str) -> None:
    with pytest.raises(ArenaError, match="invalid L1 arena name"):
        SharedArena.create(bad, 4096)


def test_an_arena_larger_than_dev_shm_is_refused_with_the_fix() -> None:
    st = os.statvfs(SHM_DIR)
    too_big = st.f_blocks * st.f_frsize * 2
    name = default_arena_name()
    with pytest.raises(ArenaError, match="shm-size"):
        SharedArena.create(name, too_big)
    assert not (SHM_DIR / name).exists()


def test_only_the_owner_may_unlink() -> None:
    with SharedArena.create(default_arena_name(), 4096) as arena:
        other = SharedArena.attach(arena.name)
        with pytest.raises(ArenaError, match="only the process that created"):
            other.unlink()
        other.close()


def test_views_outside_the_arena_are_refused() -> None:
    with SharedArena.create(default_arena_name(), 4096) as arena:
        with pytest.raises(ArenaError, match="outside"):
            arena.view(4000, 100)


def test_a_view_handed_out_before_close_stays_readable() -> None:
    arena = SharedArena.create(default_arena_name(), 4096)
    view = arena.view(0, 3)
    view[:] = b"abc"
    arena.close()
    arena.unlink()
    assert bytes(view) == b"abc"
    with pytest.raises(ArenaError, match="closed"):
        arena.view(0, 1)


# -- across processes --------------------------------------------------------------------------------
def test_another_process_reads_exactly_the_committed_bytes(make_l1, spawn_pool: ProcessPoolExecutor) -> None:
    tier = make_l1(size_bytes=256 * 1024)
    key = make_key(1)
    payload = payload_for(key, 70_001)
    tier.put(key, payload)
    handle = tier.pin(key)
    assert handle is not None
    slot = tier.slot_of(handle)
    try:
        seen = spawn_pool.submit(_child_read, tier.arena_name, slot.offset, slot.nbytes).result(60)
    finally:
        tier.release(handle)
    assert seen == payload


def test_another_process_fills_a_reservation_that_the_owner_commits(
    make_l1, spawn_pool: ProcessPoolExecutor
) -> None:
    tier = make_l1(size_bytes=256 * 1024)
    key = make_key(2)
    payload = payload_for(key, 12_345)
    handle = tier.reserve(key, len(payload))
    slot = tier.slot_of(handle)
    spawn_pool.submit(_child_write, tier.arena_name, slot.offset, payload).result(60)
    tier.commit(handle)
    assert tier.get(key) == payload


def test_a_child_exiting_does_not_remove_the_arena(make_l1, spawn_pool: ProcessPoolExecutor) -> None:
    tier = make_l1()
    spawn_pool.submit(_child_read, tier.arena_name, 0, 1).result(60)
    spawn_pool.shutdown(wait=True)
    assert (SHM_DIR / tier.arena_name).exists()


def test_arenas_of_dead_servers_are_reclaimed_and_live_ones_kept() -> None:
    import multiprocessing
    import os
    import secrets

    from tiercache.l1.arena import SHM_DIR, reclaim_stale_arenas

    ctx = multiprocessing.get_context("spawn")
    dead = ctx.Process(target=int)
    dead.start()
    dead.join()
    stale = SharedArena.create(f"tiercache-{dead.pid}-{secrets.token_hex(6)}", 4096)
    live = SharedArena.create(f"tiercache-{os.getpid()}-{secrets.token_hex(6)}", 4096)
    other = SharedArena.create(f"not-tiercache-{dead.pid}", 4096)
    try:
        removed = reclaim_stale_arenas()
        assert stale.name in removed
        assert not (SHM_DIR / stale.name).exists()
        assert (SHM_DIR / live.name).exists()
        assert (SHM_DIR / other.name).exists()
    finally:
        for arena in (stale, live, other):
            arena.close()
            arena.unlink()
