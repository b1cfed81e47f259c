"""The option table: every setting of ``tiercache server``, derived from the part configs' fields.

:data:`SECTIONS` names the part configs (one TOML table each; ``""`` is the top level) and their flag
prefixes; :data:`META` gives each field what the dataclass cannot say itself: its help text, its unit
and, where the convention differs, its name. :func:`options` builds the table that drives the flags
(:mod:`tiercache.cli.server`), the ``TIERCACHE_*`` variables and the config file
(:meth:`ServerConfig.load <tiercache.config.server.ServerConfig.load>`), and
``docs/configuration.md`` (:mod:`tiercache.config.docs`).
"""

from __future__ import annotations

from tiercache.config.options import Meta, Option, Unit, build_options
from tiercache.config.parts import (
    DiskConfig,
    EngineConfig,
    GeneralOptions,
    L1Config,
    S3Config,
    ServerOptions,
)

# Sections: (name, config class, flag prefix). Top-level, ``server`` and ``engine`` options have bare
# flags (``--tiers``, ``--listen``, ``--l3-write-policy``); tier options are prefixed with their tier.
SECTIONS: tuple[tuple[str, type, str], ...] = (
    ("", GeneralOptions, ""),
    ("server", ServerOptions, ""),
    ("l1", L1Config, "l1-"),
    ("disk", DiskConfig, "disk-"),
    ("s3", S3Config, "s3-"),
    ("engine", EngineConfig, ""),
)


def _tenant_metas(section: str, what: str) -> dict[tuple[str, str], Meta]:
    """The two tenant-quota settings of a tier that keeps quotas (``what``: what its share is of)."""
    return {
        (section, "tenant_share"): Meta(
            f"Share of {what} each tenant (cache salt) may fill before its own objects are the first "
            "evicted; a tenant under its share is never evicted for one over it. 1 turns quotas off.",
            metavar="FRACTION",
        ),
        (section, "tenant_quotas"): Meta(
            f"Per-tenant shares overriding --{section}-tenant-share: TENANT=SHARE,... with tenant ids "
            "from `tiercache tenant-id SALT` (or default, for requests without a salt).",
            default_text="none",
            metavar="LIST",
        ),
    }


META: dict[tuple[str, str], Meta] = {
    # top level (GeneralOptions)
    ("", "tiers"): Meta(
        "Tiers to run, fastest first: l1,disk | l1,s3 | l1,disk,s3 (l1 alone keeps nothing across "
        "restarts). l1 is always required: workers copy KV through its shared memory.",
        metavar="LIST",
    ),
    ("", "log_level"): Meta("Log level of the server."),
    ("", "metrics_host"): Meta(
        "Address the Prometheus metrics endpoint binds to (only with --metrics-port).", metavar="HOST"
    ),
    # server
    ("server", "listen"): Meta(
        "Endpoint clients connect to: unix:///path/to/socket (owner-only, a Unix socket the request "
        "loop reads itself: the cheapest for clients on this node), ipc:///path/to/socket "
        "(owner-only, ZMQ) or tcp://HOST:PORT (ZMQ; needs --auth-secret or --curve-secret-key-file).",
        default_text="unix://$XDG_RUNTIME_DIR/tiercache/server.sock (or /tmp/tiercache-UID/server.sock)",
        metavar="ENDPOINT",
    ),
    ("server", "chunk_size"): Meta(
        "Tokens per cached chunk; must be a multiple of the inference engine's block size.",
        metavar="TOKENS",
    ),
    ("server", "separate_object_groups"): Meta(
        "Store each KV-cache group (full attention, each sliding window, recurrent state) as its own "
        "object; off puts every layer into one object."
    ),
    ("server", "auth_secret"): Meta(
        "Shared secret clients must present (required for tcp:// unless CURVE or --auth-secret-file "
        "is used): at least 128 bits of key material, e.g. `openssl rand -hex 32`. Never printed or "
        "logged; prefer --auth-secret-file or the environment variable over the flag, which shows in `ps`.",
        secret=True,
        metavar="SECRET",
    ),
    ("server", "auth_secret_file"): Meta(
        "A file whose first line is the shared secret (read once, at start): keeps it off the command "
        "line and the environment. At least 128 bits of key material, e.g. `openssl rand -hex 32`.",
        metavar="FILE",
    ),
    ("server", "curve_secret_key_file"): Meta(
        "ZMQ CURVE secret key file of the server (for tcp://).", metavar="FILE"
    ),
    ("server", "heartbeat_timeout_s"): Meta(
        "Seconds without a message after which a client's reservations and leases are dropped.",
        metavar="SECONDS",
    ),
    ("server", "io_workers"): Meta("Threads running L2/L3 calls off the request loop.", metavar="N"),
    ("server", "max_message_bytes"): Meta(
        "Largest single message accepted, in MiB.", name="max_message_mb", unit=Unit.MIB, metavar="MIB"
    ),
    ("server", "max_keys_per_request"): Meta(
        "Most keys one request may name (a lookup's chunk hashes times its groups, a pin's keys, a "
        "reserve's objects and held blocks, a commit's or release's tokens): the request loop works "
        "through a request at once, so a huge one would stall every other client. A larger request "
        "gets an 'invalid' reply naming this setting.",
        metavar="N",
    ),
    ("server", "max_holds_per_client"): Meta(
        "Most objects one client may hold at once under read leases and reservations; past it its "
        "pins and reserves get a 'busy' reply naming this setting (counted as server.refused_holds).",
        metavar="N",
    ),
    ("server", "max_tickets_per_client"): Meta(
        "Most promotion tickets (lookups with prefetch) one client may hold at once; past it its "
        "lookups get a 'busy' reply (server.refused_tickets). Tickets also end with their leases.",
        metavar="N",
    ),
    ("server", "max_reserved_share_per_client"): Meta(
        "Largest share of the L1 arena one client's open reservations may cover; past it its "
        "reserves get a 'busy' reply (server.refused_reserved_bytes), so one client cannot evict "
        "the whole arena in one go.",
        metavar="FRACTION",
    ),
    ("server", "drain_timeout_s"): Meta(
        "Seconds a shutdown waits for in-flight work before closing the tiers.", metavar="SECONDS"
    ),
    ("server", "metrics_port"): Meta(
        "Serve Prometheus metrics on http://METRICS_HOST:PORT/metrics (0: any free port).",
        default_text="off",
        metavar="PORT",
    ),
    ("server", "metrics_tenants"): Meta(
        "Tenants named in per-tenant metrics (those holding the most bytes); the rest are summed "
        'under tenant="other", so the label set stays bounded. 0: every tenant is "other".',
        metavar="N",
    ),
    # l1
    ("l1", "size_bytes"): Meta(
        "Size of the shared-memory arena in GiB (decimals allowed, e.g. 0.5); allocated in /dev/shm "
        "at start-up.",
        name="size_gb",
        unit=Unit.GIB,
        metavar="GIB",
    ),
    ("l1", "name"): Meta(
        "Name of the arena in /dev/shm that workers attach to.",
        default_text="a unique name per start",
        metavar="NAME",
    ),
    ("l1", "eviction_policy"): Meta(
        "L1 eviction policy: lru, or the frequency-aware s3fifo.", flag="--eviction-policy"
    ),
    ("l1", "alignment"): Meta("Byte alignment of arena slots (a power of two).", metavar="BYTES"),
    ("l1", "reservation_ttl_s"): Meta(
        "Seconds an uncommitted L1 reservation lives before it is freed.", metavar="SECONDS"
    ),
    ("l1", "lease_ttl_s"): Meta(
        "Seconds an unreleased L1 read lease lives before it is dropped.", metavar="SECONDS"
    ),
    ("l1", "quarantine_s"): Meta(
        "Seconds the slot of a reservation that expired, or whose client's session was dropped, stays "
        "out of use unless its writer commits or aborts it meanwhile: a stalled writer that resumes "
        "writes there, not into another object (readers' checks catch what comes later). At most a "
        "quarter of the arena is held so; 0 frees such slots at once.",
        metavar="SECONDS",
    ),
    **_tenant_metas("l1", "the arena"),
    # disk
    ("disk", "path"): Meta(
        "Directory of the LMDB environment (created owner-only).",
        default_text="$XDG_DATA_HOME/tiercache/disk (or ~/.local/share/tiercache/disk)",
        metavar="DIR",
    ),
    ("disk", "budget_bytes"): Meta(
        "Payload budget of the disk tier in GiB (decimals allowed).",
        name="size_gb",
        unit=Unit.GIB,
        metavar="GIB",
    ),
    ("disk", "high_watermark"): Meta(
        "Fraction of the budget at which disk eviction starts.", metavar="FRACTION"
    ),
    ("disk", "low_watermark"): Meta(
        "Fraction of the budget at which disk eviction stops.", metavar="FRACTION"
    ),
    ("disk", "map_headroom"): Meta(
        "LMDB map size as a multiple of the budget (>= 1.3; room for fragmentation).",
        metavar="FACTOR",
    ),
    ("disk", "sync_interval_s"): Meta(
        "Seconds durability may lag (a background thread syncs LMDB).", metavar="SECONDS"
    ),
    ("disk", "compress"): Meta("Compress disk objects with zstd."),
    ("disk", "reservation_ttl_s"): Meta("Seconds an uncommitted disk reservation lives.", metavar="SECONDS"),
    ("disk", "lease_ttl_s"): Meta("Seconds an unreleased disk read lease lives.", metavar="SECONDS"),
    **_tenant_metas("disk", "the disk budget"),
    # s3
    ("s3", "bucket"): Meta("S3 bucket (required with the s3 tier).", default_text="none", metavar="BUCKET"),
    ("s3", "prefix"): Meta("Key prefix of this deployment's objects.", metavar="PREFIX"),
    ("s3", "endpoint_url"): Meta(
        "S3-compatible endpoint, e.g. http://127.0.0.1:9000 (default: AWS).", metavar="URL"
    ),
    ("s3", "region"): Meta("S3 region (default: boto3's configuration).", metavar="REGION"),
    ("s3", "path_style"): Meta("Use path-style addressing (most S3-compatible stores need it)."),
    ("s3", "capacity_bytes"): Meta(
        "Bound on the bytes under the prefix in GiB; the oldest objects are deleted beyond it.",
        name="capacity_gb",
        unit=Unit.GIB,
        metavar="GIB",
    ),
    ("s3", "max_concurrency"): Meta("Concurrent S3 requests (connection pool size).", metavar="N"),
    ("s3", "connect_timeout_s"): Meta("S3 connect timeout in seconds.", metavar="SECONDS"),
    ("s3", "read_timeout_s"): Meta("S3 read timeout in seconds.", metavar="SECONDS"),
    ("s3", "max_attempts"): Meta(
        "Attempts per S3 request, retries included (existence checks: one, see --s3-head-timeout-s).",
        metavar="N",
    ),
    ("s3", "head_timeout_s"): Meta(
        "Read timeout of an existence check (HEAD), made once: lookups wait on it, and one that times "
        "out counts towards the breaker.",
        metavar="SECONDS",
    ),
    ("s3", "breaker_failures"): Meta(
        "Consecutive S3 failures that open the circuit breaker (requests are skipped).", metavar="N"
    ),
    ("s3", "breaker_cooldown_s"): Meta(
        "Seconds the breaker stays open before S3 is tried again.", metavar="SECONDS"
    ),
    ("s3", "exists_ttl_s"): Meta("Seconds a cached 'object exists' answer is trusted.", metavar="SECONDS"),
    ("s3", "missing_ttl_s"): Meta("Seconds a cached 'object missing' answer is trusted.", metavar="SECONDS"),
    ("s3", "compress"): Meta("Compress S3 objects with zstd."),
    ("s3", "lease_ttl_s"): Meta("Seconds an unreleased S3 read lease lives.", metavar="SECONDS"),
    ("s3", "reservation_ttl_s"): Meta("Seconds an uncommitted S3 upload lives.", metavar="SECONDS"),
    ("s3", "create_bucket"): Meta("Create the bucket at start-up if it does not exist."),
    ("s3", "relist_interval_s"): Meta(
        "Seconds between listings of the prefix, so the capacity bound also counts (and evicts) what "
        "other nodes wrote; 0 lists only at start-up.",
        metavar="SECONDS",
    ),
    # engine
    ("engine", "l3_write_policy"): Meta(
        "When chunks go to S3: through (after disk, asynchronously) or back (when evicted from disk; "
        "needs the disk tier)."
    ),
    ("engine", "l3_admission"): Meta(
        "Which chunks are written to S3: all (every chunk the write policy hands over) or read (only "
        "chunks read at least once since they were stored: with write-through at their first read, "
        "with write-back on disk eviction if they were read; the others are refused and counted). "
        "read needs the disk tier; see docs/s3.md#admission for what it saves and costs."
    ),
    ("engine", "l3_admission_window"): Meta(
        "Stored chunks --l3-admission read remembers while they wait for their first read (about "
        "300 bytes each, the key included); the oldest are forgotten, and refused, beyond it. Size it to the disk's "
        "chunks (its budget over the chunk size) so that a chunk is not forgotten while on disk.",
        metavar="N",
    ),
    ("engine", "tail_index_blocks"): Meta(
        "Block hashes the block index remembers (about 170 bytes each): for tails (the vLLM "
        "connector's tails setting), which stored object holds each block of a chunk, so a prompt "
        "shorter than a stored tail or chunk loads the blocks it shares with it. The least recently "
        "asked are forgotten beyond it; size it to about the blocks past the last full chunk of the "
        "requests the cache holds, times the blocks per chunk. With a disk tier, a clean stop keeps "
        "the index there for the next start.",
        metavar="N",
    ),
    ("engine", "write_queue_depth"): Meta(
        "Bound of each queue to a lower tier (write-through, and write-back to S3); a full queue "
        "drops and counts the write: under write-back the chunk is then lost (docs/caveats.md).",
        metavar="N",
    ),
    ("engine", "promote_workers"): Meta("Threads promoting lower-tier hits into L1.", metavar="N"),
    ("engine", "write_workers"): Meta("Threads per write-through queue.", metavar="N"),
    ("engine", "remote_lookup_budget_s"): Meta(
        "Longest a lookup waits for S3's answers; then it answers what L1 and disk hold (counted as "
        "remote_lookups_late). Keep it under the connector's lookup timeout.",
        metavar="SECONDS",
    ),
    ("engine", "remote_lookup_workers"): Meta(
        "Threads asking S3 for lookups, apart from the I/O workers that serve L1 and disk.", metavar="N"
    ),
}

SECTION_TITLES = {
    "": "general",
    "server": "server (listening, clients, shutdown)",
    "l1": "L1: shared host memory",
    "disk": "L2: disk (LMDB)",
    "s3": "L3: S3 or S3-compatible object store",
    "engine": "engine (moving chunks between tiers)",
}


def options() -> tuple[Option, ...]:
    """Every option, top-level ones first, then by part (server, l1, disk, s3, engine)."""
    return build_options(SECTIONS, META)


def options_by_key() -> dict[str, Option]:
    """:func:`options` keyed by :attr:`Option.key`."""
    return {opt.key: opt for opt in options()}
