"""Validated, frozen settings for each part: the tiers, the engine that composes them, the server.

These are the single source of truth: the option table (:mod:`tiercache.config.options`) derives
every flag, ``TIERCACHE_*`` variable and config-file key from their fields; nothing else re-declares
the option list. Every check raises :class:`~tiercache.errors.SettingError` naming the field, so a
loader can say where the bad value came from; the default wording names the flag and the fix.
"""

from __future__ import annotations

import enum
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from tiercache.config.units import GiB, MiB
from tiercache.config.values import (
    DEFAULT_TIERS,
    parse_tenant_shares,
    parse_tier_list,
    read_secret_file,
    secret_weakness,
)
from tiercache.errors import SettingError


class EvictionPolicyName(enum.StrEnum):
    """L1 eviction policies: ``lru`` (default) or the frequency-aware ``s3fifo``."""

    LRU = "lru"
    S3FIFO = "s3fifo"


class L3WritePolicy(enum.StrEnum):
    """When committed chunks go to S3: ``through`` (after L2, asynchronously) or ``back`` (on L2 eviction)."""

    THROUGH = "through"
    BACK = "back"


class L3Admission(enum.StrEnum):
    """Which chunks the engine writes to S3 (docs/s3.md#admission): ``all`` (every chunk the write
    policy hands over) or ``read`` (only chunks read at least once since they were stored)."""

    ALL = "all"
    READ = "read"


class LogLevel(enum.StrEnum):
    """Log levels of the server's own logger."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


def _positive(name: str, label: str, value: float, unit: str = "") -> None:
    if not value > 0:
        raise SettingError(name, label, f"must be > 0{unit}, got {value!r}; give a positive value")


def _fraction(name: str, label: str, value: float) -> None:
    if not 0 < value <= 1:
        raise SettingError(name, label, f"must be in (0, 1], got {value!r}; give a fraction such as 0.9")


def _tenant_overrides(text: str, flag: str) -> dict[bytes, float]:
    try:
        return parse_tenant_shares(text)
    except ValueError as exc:
        raise SettingError("tenant_quotas", flag, str(exc)) from None


def _at_least_one(name: str, label: str, value: int, fix: str = "") -> None:
    if value < 1:
        raise SettingError(name, label, f"must be >= 1, got {value}{fix}")


@dataclass(frozen=True, slots=True)
class GeneralOptions:
    """The top-level settings: which tiers run (fastest first), how the server logs, and the address
    its metrics endpoint binds to."""

    tiers: tuple[str, ...] = DEFAULT_TIERS
    log_level: LogLevel = LogLevel.INFO
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiers", parse_tier_list(self.tiers))
        object.__setattr__(self, "log_level", LogLevel(self.log_level))
        if not self.metrics_host:
            raise SettingError("metrics_host", "--metrics-host", "is empty; use an address such as 127.0.0.1")


@dataclass(frozen=True, slots=True)
class L1Config:
    """The shared host-memory arena.

    ``name`` is the shared-memory object (``/dev/shm/<name>``) that workers attach to; ``None`` picks a
    unique name. Reservations and read leases expire after their TTLs so a crashed client cannot leak
    the arena.

    Tenant quotas (:mod:`tiercache.l1.tenants`): each tenant may hold ``tenant_share`` of the arena
    before its own objects are the first to go, unless ``tenant_quotas`` (``TENANT=SHARE,...``) gives
    it another share. ``1.0`` with no overrides: no quotas, one eviction order for everyone.
    """

    size_bytes: int = 1 * GiB
    name: str | None = None
    eviction_policy: EvictionPolicyName = EvictionPolicyName.LRU
    alignment: int = 4096
    reservation_ttl_s: float = 30.0
    lease_ttl_s: float = 60.0
    #: How long the slot of a reservation that ended without its writer's word (expired, or its
    #: session dropped) stays out of use, so that a late write lands there and in no other object.
    quarantine_s: float = 300.0
    tenant_share: float = 1.0
    tenant_quotas: str = ""

    def __post_init__(self) -> None:
        _positive("size_bytes", "--l1-size-gb", self.size_bytes, " bytes")
        _fraction("tenant_share", "--l1-tenant-share", self.tenant_share)
        self.tenant_overrides()  # validates
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise SettingError(
                "alignment", "L1 alignment", f"must be a power of two, got {self.alignment}; use e.g. 4096"
            )
        _positive("reservation_ttl_s", "L1 reservation TTL", self.reservation_ttl_s, " s")
        _positive("lease_ttl_s", "L1 lease TTL", self.lease_ttl_s, " s")
        if self.quarantine_s < 0:
            raise SettingError(
                "quarantine_s", "--l1-quarantine-s", f"must be >= 0 seconds, got {self.quarantine_s}"
            )

    def tenant_overrides(self) -> dict[bytes, float]:
        """``tenant_quotas`` parsed: tenant id → share of the arena."""
        return _tenant_overrides(self.tenant_quotas, "--l1-tenant-quotas")


@dataclass(frozen=True, slots=True)
class DiskConfig:
    """The LMDB tier at ``path``.

    ``budget_bytes`` bounds payload bytes; eviction starts above ``high_watermark`` × budget and stops at
    ``low_watermark`` × budget. The LMDB map is sized ``map_headroom`` × budget (+64 MiB) because large
    values need *contiguous* free pages (measured: mixed sizes settle ~25% above live data), so
    ``MDB_MAP_FULL`` does not happen in steady state. ``sync_interval_s`` is how far durability may lag
    (writes are ``sync=False`` and a background thread calls ``env.sync()``); LMDB stays consistent
    after a crash either way.

    Tenant quotas work as L1's (:class:`L1Config`), on the byte budget: a tenant over
    ``tenant_share`` (or its ``tenant_quotas`` override) loses its own objects first.
    """

    path: Path
    budget_bytes: int = 10 * GiB
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    map_headroom: float = 1.5
    sync_interval_s: float = 1.0
    compress: bool = False
    reservation_ttl_s: float = 30.0
    lease_ttl_s: float = 60.0
    tenant_share: float = 1.0
    tenant_quotas: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        _positive("budget_bytes", "--disk-size-gb", self.budget_bytes, " bytes")
        _fraction("tenant_share", "--disk-tenant-share", self.tenant_share)
        self.tenant_overrides()  # validates
        _fraction("high_watermark", "disk high watermark", self.high_watermark)
        _fraction("low_watermark", "disk low watermark", self.low_watermark)
        if self.low_watermark >= self.high_watermark:
            raise SettingError(
                "low_watermark",
                "disk low watermark",
                f"{self.low_watermark} must be below the high watermark {self.high_watermark}",
            )
        if self.map_headroom < 1.3:
            raise SettingError(
                "map_headroom",
                "disk map headroom",
                f"{self.map_headroom} is below 1.3; LMDB needs room for fragmentation of large values "
                "(use 1.3 or more)",
            )
        _positive("sync_interval_s", "disk sync interval", self.sync_interval_s, " s")

    def tenant_overrides(self) -> dict[bytes, float]:
        """``tenant_quotas`` parsed: tenant id → share of the budget."""
        return _tenant_overrides(self.tenant_quotas, "--disk-tenant-quotas")


@dataclass(frozen=True, slots=True)
class S3Config:
    """The S3 (or S3-compatible) tier.

    Objects live at ``s3://<bucket>/<prefix>/<fingerprint>/g<group>/<prefix hash>``. ``capacity_bytes``
    bounds the bytes of objects under ``prefix`` (this deployment's namespace); the oldest are deleted
    beyond it. Credentials come from boto3's standard chain and are never logged.
    """

    bucket: str
    prefix: str = "tiercache"
    endpoint_url: str | None = None
    region: str | None = None
    path_style: bool = False
    capacity_bytes: int = 1024 * GiB
    max_concurrency: int = 8
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 10.0
    max_attempts: int = 3
    #: An existence check (HEAD) is made once, with this read timeout: a lookup waits on it, and a
    #: HEAD that times out counts towards the breaker, so a slow S3 is skipped within a few lookups.
    head_timeout_s: float = 0.5
    breaker_failures: int = 5
    breaker_cooldown_s: float = 10.0
    exists_ttl_s: float = 300.0
    missing_ttl_s: float = 5.0
    compress: bool = False
    lease_ttl_s: float = 60.0
    reservation_ttl_s: float = 30.0
    create_bucket: bool = False
    relist_interval_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.bucket:
            raise SettingError("bucket", "--s3-bucket", "is required when the s3 tier is enabled")
        object.__setattr__(self, "prefix", self.prefix.strip("/"))
        _positive("capacity_bytes", "S3 capacity", self.capacity_bytes, " bytes")
        _at_least_one("max_concurrency", "S3 max concurrency", self.max_concurrency)
        _at_least_one("max_attempts", "S3 max attempts", self.max_attempts)
        _positive("connect_timeout_s", "S3 connect timeout", self.connect_timeout_s, " s")
        _positive("read_timeout_s", "S3 read timeout", self.read_timeout_s, " s")
        _positive("head_timeout_s", "S3 HEAD timeout", self.head_timeout_s, " s")
        _at_least_one("breaker_failures", "S3 breaker failures", self.breaker_failures)
        if self.relist_interval_s < 0:
            raise SettingError(
                "relist_interval_s",
                "S3 relist interval",
                f"must be >= 0 s, got {self.relist_interval_s!r}; 0 lists the prefix only at start-up",
            )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine moves chunks between tiers.

    Queues are bounded: when one is full the write is dropped and counted, never blocking a caller.
    """

    l3_write_policy: L3WritePolicy = L3WritePolicy.THROUGH
    #: ``read``: a chunk goes to S3 only once it has been read since it was stored (write-through: at
    #: its first read; write-back: on disk eviction if it was read); the others are refused, counted.
    l3_admission: L3Admission = L3Admission.ALL
    #: How many stored chunks ``read`` remembers while they wait for their first read (oldest
    #: forgotten first; a forgotten chunk is refused): bounds the rule's memory (~300 B a chunk,
    #: ~20 MB at the default).
    l3_admission_window: int = 65536
    #: How many block hashes the block index remembers (tails: which stored object holds a block;
    #: ~170 B each, ~45 MB at the default), least recently asked forgotten first.
    tail_index_blocks: int = 262144
    write_queue_depth: int = 256
    promote_workers: int = 4
    write_workers: int = 2
    #: A lookup waits at most this long for the remote tiers' (S3's) answers, from its first
    #: question to them; then it answers what L1 and disk hold. Keep it under the connector's
    #: lookup timeout (2 s by default).
    remote_lookup_budget_s: float = 1.0
    #: Threads asking remote tiers for lookups (never the I/O workers serving L1 and disk).
    remote_lookup_workers: int = 4

    def __post_init__(self) -> None:
        _at_least_one(
            "l3_admission_window",
            "--l3-admission-window",
            self.l3_admission_window,
            "; use e.g. the disk budget divided by the chunk size",
        )
        _at_least_one(
            "tail_index_blocks",
            "--tail-index-blocks",
            self.tail_index_blocks,
            "; use e.g. 262144 (the default)",
        )
        _at_least_one(
            "write_queue_depth", "--write-queue-depth", self.write_queue_depth, "; use e.g. 256 (the default)"
        )
        _at_least_one(
            "promote_workers", "--promote-workers", self.promote_workers, "; use e.g. 4 (the default)"
        )
        _at_least_one("write_workers", "--write-workers", self.write_workers, "; use e.g. 2 (the default)")
        _at_least_one(
            "remote_lookup_workers",
            "--remote-lookup-workers",
            self.remote_lookup_workers,
            "; use e.g. 4 (the default)",
        )
        _positive("remote_lookup_budget_s", "--remote-lookup-budget-s", self.remote_lookup_budget_s, " s")


def default_runtime_dir() -> Path:
    """Per-user runtime directory for sockets: ``$XDG_RUNTIME_DIR/tiercache`` or ``/tmp/tiercache-<uid>``."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base:
        return Path(base) / "tiercache"
    return Path(f"/tmp/tiercache-{os.getuid()}")


def runtime_dir_problem(directory: Path) -> str | None:
    """Why ``directory``, the default socket directory, cannot be trusted (``None``: it can, or it
    does not exist yet): it must be a real directory (not a symlink) owned by this user. Without
    ``XDG_RUNTIME_DIR`` it is in ``/tmp``, where another local user could have made it first, and
    would then own the socket a server binds and a client connects to."""
    try:
        st = directory.lstat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot check the socket directory {directory}: {exc}"
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
        return None
    what = (
        "is not a directory (a symlink or a file)"
        if not stat.S_ISDIR(st.st_mode)
        else f"belongs to uid {st.st_uid}"
    )
    return (
        f"the socket directory {directory} {what}, not to this user (uid {os.getuid()}): another local user "
        "may have made it to take the server's socket over; remove it, or set XDG_RUNTIME_DIR (or the "
        "endpoint) to a directory of your own"
    )


def default_endpoint() -> str:
    """Where a server listens, and clients connect, unless told otherwise: a ``unix://`` socket in
    the per-user runtime directory (the cheapest transport on one node: no libzmq I/O thread on
    either side)."""
    return f"unix://{default_runtime_dir() / 'server.sock'}"


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """How the server listens and treats clients (the tiers have their own configs).

    ``listen`` is ``unix://PATH`` (owner-only; default: :func:`default_endpoint`; a Unix stream
    socket the request loop reads itself, without libzmq: :mod:`tiercache.server.unix`),
    ``ipc://PATH`` (ZMQ, owner-only) or ``tcp://HOST:PORT`` (ZMQ), which requires
    ``auth_secret`` or ``curve_secret_key_file``.
    ``chunk_size`` is in tokens; every connector must use the server's value. A client that sends
    nothing for ``heartbeat_timeout_s`` loses its reservations and read leases. ``io_workers`` bounds
    the executor that runs L2/L3 calls off the request loop. ``max_message_bytes`` bounds any single
    message (a put over the socket included).
    """

    listen: str = ""
    chunk_size: int = 256
    separate_object_groups: bool = True
    auth_secret: str | None = field(default=None, repr=False)  # never printed or logged
    #: A file whose first line is the shared secret (read once, at start), instead of auth_secret.
    auth_secret_file: Path | None = None
    curve_secret_key_file: Path | None = None
    heartbeat_timeout_s: float = 15.0
    io_workers: int = 4
    max_message_bytes: int = 64 * MiB
    #: Keys (chunk hashes × groups, tokens, objects) one request may name: the loop works through
    #: them at once, so one huge request would stall every other client for as long.
    max_keys_per_request: int = 16384
    #: What one client (session) may hold at once: read leases and reservations, promotion
    #: tickets, and the share of the L1 arena in its open reservations. One client past a bound is
    #: refused (``busy``, naming the setting) and the others are not touched.
    max_holds_per_client: int = 65536
    max_tickets_per_client: int = 4096
    max_reserved_share_per_client: float = 0.5
    drain_timeout_s: float = 10.0
    metrics_port: int | None = None
    metrics_tenants: int = 10

    def __post_init__(self) -> None:
        if not self.listen:
            object.__setattr__(self, "listen", default_endpoint())
        if not self.listen.startswith(("ipc://", "unix://", "tcp://")):
            raise SettingError(
                "listen",
                "--listen",
                f"{self.listen!r} is not supported; use ipc:///path/to/socket, unix:///path/to/socket "
                "or tcp://HOST:PORT",
            )
        if self.auth_secret_file is not None and not self.auth_secret:
            object.__setattr__(self, "auth_secret", read_secret_file(Path(self.auth_secret_file)))
        if self.auth_secret:
            weak = secret_weakness(self.auth_secret)
            if weak is not None:
                raise SettingError("auth_secret", "--auth-secret", weak)
        if self.listen.startswith("tcp://") and not (self.auth_secret or self.curve_secret_key_file):
            raise SettingError(
                "listen",
                "--listen",
                f"{self.listen} is TCP, which needs authentication: set --auth-secret-file (or "
                "TIERCACHE_AUTH_SECRET) or --curve-secret-key-file",
            )
        if self.chunk_size <= 0:
            raise SettingError(
                "chunk_size", "--chunk-size", f"must be a positive number of tokens, got {self.chunk_size}"
            )
        _positive("heartbeat_timeout_s", "heartbeat timeout", self.heartbeat_timeout_s, " s")
        _positive("drain_timeout_s", "drain timeout", self.drain_timeout_s, " s")
        _at_least_one("io_workers", "io workers", self.io_workers)
        if self.max_keys_per_request < 1024:
            raise SettingError(
                "max_keys_per_request",
                "--max-keys-per-request",
                f"must be >= 1024 (a 128k-token prompt's lookup names 512 chunks per group), got "
                f"{self.max_keys_per_request}",
            )
        _at_least_one("max_holds_per_client", "--max-holds-per-client", self.max_holds_per_client)
        _at_least_one("max_tickets_per_client", "--max-tickets-per-client", self.max_tickets_per_client)
        _fraction(
            "max_reserved_share_per_client",
            "--max-reserved-share-per-client",
            self.max_reserved_share_per_client,
        )
        if self.max_message_bytes < 1 * MiB:
            raise SettingError(
                "max_message_bytes", "max message bytes", f"must be >= 1 MiB, got {self.max_message_bytes}"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise SettingError(
                "metrics_port", "--metrics-port", f"{self.metrics_port} is not a port number (0-65535)"
            )
        if self.metrics_tenants < 0:
            raise SettingError(
                "metrics_tenants", "--metrics-tenants", f"must be >= 0, got {self.metrics_tenants}"
            )
