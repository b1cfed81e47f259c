"""The shared L1 arena: one file in ``/dev/shm`` that the server creates and worker processes map.

Why a plain file + ``mmap`` rather than :mod:`multiprocessing.shared_memory`: in Python 3.11 every
process that *attaches* a ``SharedMemory`` registers it with its resource tracker, which unlinks the
segment when that process exits — a vLLM worker restarting would delete the server's arena. Here
only the owner (the process that called :meth:`SharedArena.create`) ever unlinks.

The file is created ``O_CREAT | O_EXCL`` with mode ``0o600``: only the server's user can attach, and a
name collision is an error rather than a silent takeover of somebody else's arena. Its pages are
allocated up front (``posix_fallocate``) so that a full ``/dev/shm`` is a clear error at start-up
instead of a ``SIGBUS`` in a worker in the middle of a copy.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from tiercache.config.units import format_bytes
from tiercache.errors import ArenaError

log = logging.getLogger(__name__)

#: Where POSIX shared memory lives on Linux; a tmpfs.
SHM_DIR = Path("/dev/shm")

# A single path component: no "/", no leading "." (hidden files, "..").
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")


def default_arena_name() -> str:
    """A fresh, unique arena name (``tiercache-<pid>-<random>``)."""
    return f"tiercache-{os.getpid()}-{secrets.token_hex(6)}"


_DEFAULT_NAME = re.compile(r"^tiercache-(\d+)-[0-9a-f]{12}$")


def reclaim_stale_arenas() -> list[str]:
    """Remove default-named arenas (``tiercache-<pid>-…``) of this user whose server process is gone.

    A server killed with SIGKILL (or forced out by a second signal) cannot unlink its arena, and a
    leaked arena keeps its whole size of ``/dev/shm`` memory. Only arenas whose pid no longer exists
    are removed; a live pid, even if reused by another program, is left alone. Returns the names.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        m = _DEFAULT_NAME.match(entry.name)
        if m is None:
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != uid:
                continue
            os.kill(int(m.group(1)), 0)
            continue  # the process exists: not ours to judge
        except ProcessLookupError:
            pass
        except OSError:
            continue  # e.g. EPERM: a live process of another user
        _unlink_quietly(Path(entry.path))
        removed.append(entry.name)
    return removed


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ArenaError(
            f"invalid L1 arena name {name!r}: use 1-201 characters from A-Z a-z 0-9 _ . - "
            "(no '/', not starting with '.')"
        )


def _advise_huge_pages(mapping: mmap.mmap) -> None:
    """Ask for transparent huge pages on the arena where the host allows it for shared memory.

    Copies into 4 KiB-paged memory miss the TLB far more often: a 256 KiB memcpy into private memory
    with huge pages ran up to ~2x faster here than into /dev/shm without them. Takes effect only if
    ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` is ``advise`` (or ``always``); harmless
    otherwise.
    """
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mapping.madvise(advice)
        except OSError:
            pass  # not supported for this mapping: plain pages it is


#: ``madvise`` advice (Linux 5.14+): map every page of a range into this process's page tables,
#: writable, without touching the bytes. Python's ``mmap`` module names it only from 3.13.
_MADV_POPULATE_WRITE = 23


def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise``, called through ctypes: unlike ``mmap.madvise`` it lets go of the GIL, and
    populating a large arena takes a while. ``None`` where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class SharedArena:
    """A fixed-size shared-memory region, created by its owner and attachable by name.

    Not thread-safe by itself and it does not need to be: the region is a plain byte range; who may
    touch which bytes is decided by the allocator of :class:`~tiercache.l1.tier.L1Tier`.
    Views returned by :meth:`view` stay valid after :meth:`close` until the last of them is dropped
    (the mapping is released then), so a late reader never faults.
    """

    def __init__(self, name: str, mapping: mmap.mmap, size: int, *, owner: bool) -> None:
        """Use :meth:`create` or :meth:`attach`; this only wraps an existing mapping."""
        self._name = name
        self._path = SHM_DIR / name
        self._mmap: mmap.mmap | None = mapping
        self._base: memoryview | None = memoryview(mapping)
        self._size = size
        self._owner = owner
        self._unlinked = False
        self._lock_fd: int | None = None  # the owner's locked descriptor of the file (create())

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def create(cls, name: str | None, size: int, *, prefault: bool = True) -> SharedArena:
        """Create ``/dev/shm/<name>`` of ``size`` bytes (owner-only) and map it.

        Runs once in the server at start-up. Costs one file creation plus, with ``prefault``, the
        kernel zeroing ``size`` bytes of tmpfs pages (roughly the time of one memset of the arena),
        which turns "``/dev/shm`` too small" into an :class:`ArenaError` now rather than a ``SIGBUS``
        later. ``name=None`` picks a unique name.
        """
        name = default_arena_name() if name is None else name
        _check_name(name)
        if size <= 0:
            raise ArenaError(f"L1 arena size must be > 0 bytes, got {size}")
        _check_room(size)
        path = SHM_DIR / name
        fd = _create_file(path, name)
        mapping = _size_and_map(fd, path, size, prefault)
        arena = cls(name, mapping, size, owner=True)
        arena._lock_fd = fd  # kept open: it holds the owner's lock
        return arena

    @classmethod
    def attach(cls, name: str) -> SharedArena:
        """Map the existing arena ``name`` (in a worker process). Costs one ``open`` + ``mmap``."""
        _check_name(name)
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError as exc:
            raise ArenaError(
                f"no L1 arena named {name!r} in {SHM_DIR}; is the tiercache server running, and does "
                "the name match its --l1-name?"
            ) from exc
        except PermissionError as exc:
            raise ArenaError(
                f"permission denied opening L1 arena {path}: the arena is owner-only; run the "
                "worker as the same user as the tiercache server"
            ) from exc
        except OSError as exc:
            raise ArenaError(
                f"cannot open L1 arena {path}: {exc.strerror}; check that the tiercache server runs and that "
                "--l1-name matches"
            ) from exc
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid():
                raise ArenaError(
                    f"L1 arena {path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}): it is not "
                    "your server's; check the endpoint, and run the server and its clients as one user"
                )
            if st.st_mode & 0o077:
                # A server makes it 0600: one others may open is not what it made, or was changed.
                raise ArenaError(
                    f"L1 arena {path} has mode {st.st_mode & 0o777:o}, open to other users; a tiercache server "
                    "makes its arena 0600: restart the server, and let nothing else change the file's mode"
                )
            size = st.st_size
            if size <= 0:
                raise ArenaError(
                    f"L1 arena {path} is empty; it is still being created or is not a tiercache arena"
                )
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            _advise_huge_pages(mapping)
        except OSError as exc:
            raise ArenaError(
                f"cannot map L1 arena {path}: {exc.strerror or exc}; check this process's memory limits (ulimit -v, "
                "cgroup)"
            ) from exc
        finally:
            os.close(fd)
        return cls(name, mapping, size, owner=False)

    # -- access ------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The name other processes pass to :meth:`attach`."""
        return self._name

    @property
    def path(self) -> Path:
        """The backing file, ``/dev/shm/<name>``."""
        return self._path

    @property
    def size(self) -> int:
        """Mapped bytes."""
        return self._size

    @property
    def owner(self) -> bool:
        """Whether this process created the arena (and may unlink it)."""
        return self._owner

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._base is None

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A writable view of ``nbytes`` at ``offset``. O(1), no copy; any process, any thread."""
        base = self._base
        if base is None:
            raise ArenaError(f"L1 arena {self._name!r} is closed; attach it again")
        if offset < 0 or nbytes < 0 or offset + nbytes > self._size:
            raise ArenaError(
                f"range [{offset}, {offset + nbytes}) is outside L1 arena {self._name!r} of "
                f"{self._size} bytes"
            )
        return base[offset : offset + nbytes]

    def populate(self, step: int = 64 << 20) -> bool:
        """Map every page of the arena into this process's page tables now; whether all of them
        were (``False``: closed meanwhile, or a kernel older than 5.14).

        The arena's pages exist from :meth:`create` on, but each process maps a page only on its
        first access, a fault per 4 KiB page, which made the first copy into a fresh mapping several
        times slower than the next on the machines here. Populating ahead moves that cost off the
        copies. The bytes are not touched, so it may run while others copy; it works
        ``step`` bytes at a time without the GIL and stops once the arena is closed.
        """
        mapping, madvise = self._mmap, _madvise()
        if mapping is None or madvise is None:
            return False
        try:
            # An export of the mapping: close() leaves it mapped until this is dropped.
            anchor = ctypes.c_char.from_buffer(mapping)
        except (ValueError, TypeError, BufferError):
            return False
        base = ctypes.addressof(anchor)
        for start in range(0, self._size, step):
            if self._base is None:
                return False
            if madvise(base + start, min(step, self._size - start), _MADV_POPULATE_WRITE) != 0:
                return False  # EINVAL before Linux 5.14: the copies fault the pages in instead
        return True

    def populate_in_background(
        self, on_done: Callable[[bool, float], None] | None = None
    ) -> threading.Thread:
        """:meth:`populate` on a daemon thread; ``on_done(populated, seconds)`` when it ends."""

        def run() -> None:
            t0 = time.monotonic()
            done = self.populate()
            if on_done is not None:
                on_done(done, time.monotonic() - t0)

        thread = threading.Thread(target=run, name="tiercache-arena-populate", daemon=True)
        thread.start()
        return thread

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Drop this process's mapping. Idempotent.

        Views still held elsewhere keep the memory mapped until they are released (CPython keeps the
        ``mmap`` alive for them), so closing never invalidates a buffer a caller still holds.
        """
        base, mapping = self._base, self._mmap
        self._base = None
        self._mmap = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # and with it the owner's lock
            self._lock_fd = None
        if base is not None:
            base.release()
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                # Views are still exported; the mapping goes when the last one is dropped.
                pass

    def unlink(self) -> None:
        """Remove the backing file (owner only). Idempotent.

        Processes that already mapped the arena keep their mapping; nobody can attach afterwards.
        """
        if not self._owner:
            raise ArenaError(
                f"only the process that created L1 arena {self._name!r} may unlink it; call close()"
            )
        if not self._unlinked:
            self._unlinked = True
            _unlink_quietly(self._path)

    def __enter__(self) -> SharedArena:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
        if self._owner:
            self.unlink()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        role = "owner" if self._owner else "attached"
        return f"SharedArena(name={self._name!r}, size={self._size}, {role}, {state})"


def _reclaim_abandoned(path: Path) -> bool:
    """Remove the arena file at ``path`` if it is this user's and no process holds its owner's
    lock (its server died without unlinking it, e.g. killed with SIGKILL); whether it did."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_uid != os.getuid():
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its server is alive
        log.warning("L1 arena %s was left by a server that is gone; removing it to start anew", path)
        _unlink_quietly(path)
        return True
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _check_room(size: int) -> None:
    """Refuse an arena of ``size`` bytes now where ``/dev/shm`` is missing or has less free."""
    if not SHM_DIR.is_dir():
        raise ArenaError(
            f"{SHM_DIR} does not exist on this host; the L1 arena needs Linux POSIX shared memory"
        )
    try:
        st = os.statvfs(SHM_DIR)
        free = st.f_bavail * st.f_frsize
    except OSError:  # cannot tell; _size_and_map's fallocate still catches a real shortage
        free = size
    if free < size:
        raise ArenaError(
            f"{SHM_DIR} has {format_bytes(free)} free but the L1 arena needs {format_bytes(size)}; "
            "lower --l1-size-gb or enlarge /dev/shm (Docker: --shm-size, Kubernetes: an "
            "emptyDir with medium: Memory)"
        )


def _create_file(path: Path, name: str) -> int:
    """Create the arena's file exclusively, owner-only, taking over the name of an arena whose
    server died (:func:`_reclaim_abandoned`); its open descriptor."""
    try:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            if not _reclaim_abandoned(path):
                raise
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except FileExistsError as exc:
        raise ArenaError(
            f"an L1 arena named {name!r} already exists ({path}) and its server is running (it holds the "
            f"arena's lock): pick another --l1-name, or stop that server"
        ) from exc
    except OSError as exc:
        raise ArenaError(
            f"cannot create L1 arena {path}: {exc.strerror}; check that {SHM_DIR} is mounted and writable by "
            "this user"
        ) from exc
    return fd


def _size_and_map(fd: int, path: Path, size: int, prefault: bool) -> mmap.mmap:
    """Take the owner's lock on the new file ``fd``, size it (allocating its pages with
    ``prefault``) and map it; on any failure close ``fd`` and remove the file."""
    try:
        # The owner's mark, held for as long as the arena is open: a server killed with SIGKILL
        # drops it with its process, so the next one may take the name over.
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # The umask may have removed bits; the owner must be able to read and write.
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        if prefault:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        _advise_huge_pages(mapping)
    except OSError as exc:
        os.close(fd)
        _unlink_quietly(path)
        if exc.errno == errno.ENOSPC:
            raise ArenaError(
                f"{SHM_DIR} ran out of space allocating the {format_bytes(size)} L1 arena; lower "
                "--l1-size-gb or enlarge /dev/shm"
            ) from exc
        raise ArenaError(
            f"cannot size or map L1 arena {path}: {exc.strerror or exc}; lower --l1-size-gb or enlarge {SHM_DIR}"
        ) from exc
    except BaseException:
        os.close(fd)
        _unlink_quietly(path)
        raise
    return mapping


@dataclass(frozen=True, slots=True)
class ArenaSlot:
    """``nbytes`` of payload at ``offset`` in the arena: what a worker needs to copy into or out of.

    Offsets are the same in every process that maps the arena, so the server sends these (not
    pointers) to workers.
    """

    offset: int
    nbytes: int
