"""The server's whole configuration: one frozen, validated :class:`ServerConfig`, and the option table.

:class:`ServerConfig` composes the per-part configs of :mod:`tiercache.config` (it does not re-declare
their fields). :data:`OPTIONS` is generated from those dataclasses' fields plus :data:`_META`, a small
map that gives each field its help text, its unit and, where the convention differs, its name. That one
table drives every way of setting a value:

* ``tiercache server`` flags (:func:`add_server_arguments`),
* ``TIERCACHE_*`` environment variables,
* an optional TOML file (``--config FILE`` or ``TIERCACHE_CONFIG``) with one table per part::

      tiers = "l1,disk,s3"      # top-level: tiers, log_level, metrics_host
      [server]                  # listen, chunk_size, auth_secret, ...
      [l1]                      # size_gb, name, eviction_policy, ...
      [disk]                    # path, size_gb, ...
      [s3]                      # bucket, prefix, endpoint_url, ...
      [engine]                  # l3_write_policy, ...

* and ``docs/configuration.md`` (:func:`render_docs`).

Precedence: flags > environment > file > defaults. Every error is one line naming where the value came
from (the flag, the variable or the file key), the value (never a secret) and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import os
import re
import tempfile
import tomllib
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiercache.config import (
    DiskConfig,
    EngineConfig,
    GiB,
    L1Config,
    L3WritePolicy,
    MiB,
    S3Config,
    ServerOptions,
)
from tiercache.errors import ConfigError, DiskTierError

if TYPE_CHECKING:  # the engine and tiers import lmdb/boto3; load them only when building
    from tiercache.engine import TieredEngine

#: Tier names in the only order they can be stacked: fastest first.
TIER_ORDER = ("l1", "disk", "s3")

#: What ``tiercache server`` runs with no flags: the embedded default.
DEFAULT_TIERS = ("l1", "disk")

#: Environment variable naming a config file (the ``--config`` flag wins over it).
CONFIG_ENV = "TIERCACHE_CONFIG"

ENV_PREFIX = "TIERCACHE_"


class LogLevel(enum.StrEnum):
    """Log levels of the server's own logger."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


def default_data_dir() -> Path:
    """The per-user data directory: ``$XDG_DATA_HOME/tiercache`` or ``~/.local/share/tiercache``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "tiercache"


def default_disk_path() -> Path:
    """Where the disk tier lives unless told otherwise: ``<per-user data dir>/disk``."""
    return default_data_dir() / "disk"


def parse_server_tiers(text: str | typing.Sequence[str], where: str = "--tiers") -> tuple[str, ...]:
    """``"l1,disk"`` → ``("l1", "disk")``: known names, no repeats, fastest first, starting with l1."""
    items = text.split(",") if isinstance(text, str) else list(text)
    tiers = tuple(str(t).strip() for t in items if str(t).strip())
    shown = ",".join(tiers) if tiers else repr(text)
    unknown = [t for t in tiers if t not in TIER_ORDER]
    if not tiers or unknown:
        raise ConfigError(
            f"{where} {shown} is not valid ({'unknown: ' + ','.join(unknown) if unknown else 'empty'}); "
            "use l1,disk, l1,s3 or l1,disk,s3"
        )
    if len(set(tiers)) != len(tiers):
        raise ConfigError(f"{where} {shown} names a tier twice; name each once, e.g. l1,disk,s3")
    if tiers[0] != "l1":
        raise ConfigError(
            f"{where} {shown} does not start with l1; l1 (the shared-memory arena) is always required "
            f"because workers copy KV through it: use l1,{','.join(t for t in tiers if t != 'l1')}"
            if "l1" not in tiers
            else f"{where} {shown} must start with l1 (tiers go fastest first): use "
            f"{','.join(t for t in TIER_ORDER if t in tiers)}"
        )
    ordered = tuple(t for t in TIER_ORDER if t in tiers)
    if tiers != ordered:
        raise ConfigError(
            f"{where} {shown} is out of order; tiers go fastest first: use {','.join(ordered)}"
        )
    return tiers


# -- the option table ------------------------------------------------------------------------------


class Unit(enum.Enum):
    """A user-facing unit: the option takes a decimal number of these; the field stores bytes."""

    GIB = ("GiB", GiB)
    MIB = ("MiB", MiB)

    @property
    def label(self) -> str:
        return self.value[0]

    @property
    def factor(self) -> int:
        return self.value[1]


@dataclass(frozen=True, slots=True)
class _Meta:
    """What the dataclass field cannot say about itself."""

    help: str
    name: str | None = None  # key in its TOML table; default: the field name
    flag: str | None = None  # default: --<section prefix><name with dashes>
    unit: Unit | None = None
    default_text: str | None = None  # for defaults computed at run time
    metavar: str | None = None
    secret: bool = False


# Sections: (name, config class, flag prefix). ``server`` and ``engine`` options have bare flags
# (``--listen``, ``--l3-write-policy``); tier options are prefixed with their tier.
_SECTIONS: tuple[tuple[str, type, str], ...] = (
    ("server", ServerOptions, ""),
    ("l1", L1Config, "l1-"),
    ("disk", DiskConfig, "disk-"),
    ("s3", S3Config, "s3-"),
    ("engine", EngineConfig, ""),
)

_META: dict[tuple[str, str], _Meta] = {
    # top level (fields of ServerConfig itself)
    ("", "tiers"): _Meta(
        "Tiers to run, fastest first: l1,disk | l1,s3 | l1,disk,s3 (l1 alone keeps nothing across "
        "restarts). l1 is always required: workers copy KV through its shared memory.",
        metavar="LIST",
    ),
    ("", "log_level"): _Meta("Log level of the server."),
    ("", "metrics_host"): _Meta(
        "Address the Prometheus metrics endpoint binds to (only with --metrics-port).", metavar="HOST"
    ),
    # server
    ("server", "listen"): _Meta(
        "ZMQ endpoint clients connect to: ipc:///path/to/socket (owner-only) or tcp://HOST:PORT "
        "(needs --auth-secret or --curve-secret-key-file).",
        default_text="ipc://$XDG_RUNTIME_DIR/tiercache/server.sock (or /tmp/tiercache-UID/server.sock)",
        metavar="ENDPOINT",
    ),
    ("server", "chunk_size"): _Meta(
        "Tokens per cached chunk; must be a multiple of the inference engine's block size.",
        metavar="TOKENS",
    ),
    ("server", "separate_object_groups"): _Meta(
        "Store each KV-cache group (full attention, each sliding window, recurrent state) as its own "
        "object; off puts every layer into one object."
    ),
    ("server", "auth_secret"): _Meta(
        "Shared secret clients must present (required for tcp:// unless CURVE is used). Never printed "
        "or logged; prefer the environment variable over the flag, which shows in `ps`.",
        secret=True,
        metavar="SECRET",
    ),
    ("server", "curve_secret_key_file"): _Meta(
        "ZMQ CURVE secret key file of the server (for tcp://).", metavar="FILE"
    ),
    ("server", "heartbeat_timeout_s"): _Meta(
        "Seconds without a message after which a client's reservations and leases are dropped.",
        metavar="SECONDS",
    ),
    ("server", "io_workers"): _Meta("Threads running L2/L3 calls off the request loop.", metavar="N"),
    ("server", "max_message_bytes"): _Meta(
        "Largest single message accepted, in MiB.", name="max_message_mb", unit=Unit.MIB, metavar="MIB"
    ),
    ("server", "drain_timeout_s"): _Meta(
        "Seconds a shutdown waits for in-flight work before closing the tiers.", metavar="SECONDS"
    ),
    ("server", "metrics_port"): _Meta(
        "Serve Prometheus metrics on http://METRICS_HOST:PORT/metrics (0: any free port).",
        default_text="off",
        metavar="PORT",
    ),
    # l1
    ("l1", "size_bytes"): _Meta(
        "Size of the shared-memory arena in GiB (decimals allowed, e.g. 0.5); allocated in /dev/shm "
        "at start-up.",
        name="size_gb",
        unit=Unit.GIB,
        metavar="GIB",
    ),
    ("l1", "name"): _Meta(
        "Name of the arena in /dev/shm that workers attach to.",
        default_text="a unique name per start",
        metavar="NAME",
    ),
    ("l1", "eviction_policy"): _Meta(
        "L1 eviction policy: lru, or the frequency-aware s3fifo.", flag="--eviction-policy"
    ),
    ("l1", "alignment"): _Meta("Byte alignment of arena slots (a power of two).", metavar="BYTES"),
    ("l1", "reservation_ttl_s"): _Meta(
        "Seconds an uncommitted L1 reservation lives before it is freed.", metavar="SECONDS"
    ),
    ("l1", "lease_ttl_s"): _Meta(
        "Seconds an unreleased L1 read lease lives before it is dropped.", metavar="SECONDS"
    ),
    # disk
    ("disk", "path"): _Meta(
        "Directory of the LMDB environment (created owner-only).",
        default_text="$XDG_DATA_HOME/tiercache/disk (or ~/.local/share/tiercache/disk)",
        metavar="DIR",
    ),
    ("disk", "budget_bytes"): _Meta(
        "Payload budget of the disk tier in GiB (decimals allowed).",
        name="size_gb",
        unit=Unit.GIB,
        metavar="GIB",
    ),
    ("disk", "high_watermark"): _Meta(
        "Fraction of the budget at which disk eviction starts.", metavar="FRACTION"
    ),
    ("disk", "low_watermark"): _Meta(
        "Fraction of the budget at which disk eviction stops.", metavar="FRACTION"
    ),
    ("disk", "map_headroom"): _Meta(
        "LMDB map size as a multiple of the budget (>= 1.3; room for fragmentation).",
        metavar="FACTOR",
    ),
    ("disk", "sync_interval_s"): _Meta(
        "Seconds durability may lag (a background thread syncs LMDB).", metavar="SECONDS"
    ),
    ("disk", "compress"): _Meta("Compress disk objects with zstd."),
    ("disk", "reservation_ttl_s"): _Meta(
        "Seconds an uncommitted disk reservation lives.", metavar="SECONDS"
    ),
    ("disk", "lease_ttl_s"): _Meta("Seconds an unreleased disk read lease lives.", metavar="SECONDS"),
    # s3
    ("s3", "bucket"): _Meta("S3 bucket (required with the s3 tier).", default_text="none", metavar="BUCKET"),
    ("s3", "prefix"): _Meta("Key prefix of this deployment's objects.", metavar="PREFIX"),
    ("s3", "endpoint_url"): _Meta(
        "S3-compatible endpoint, e.g. http://127.0.0.1:9000 (default: AWS).", metavar="URL"
    ),
    ("s3", "region"): _Meta("S3 region (default: boto3's configuration).", metavar="REGION"),
    ("s3", "path_style"): _Meta("Use path-style addressing (most S3-compatible stores need it)."),
    ("s3", "capacity_bytes"): _Meta(
        "Bound on the bytes under the prefix in GiB; the oldest objects are deleted beyond it.",
        name="capacity_gb",
        unit=Unit.GIB,
        metavar="GIB",
    ),
    ("s3", "max_concurrency"): _Meta("Concurrent S3 requests (connection pool size).", metavar="N"),
    ("s3", "connect_timeout_s"): _Meta("S3 connect timeout in seconds.", metavar="SECONDS"),
    ("s3", "read_timeout_s"): _Meta("S3 read timeout in seconds.", metavar="SECONDS"),
    ("s3", "max_attempts"): _Meta("Attempts per S3 request, retries included.", metavar="N"),
    ("s3", "breaker_failures"): _Meta(
        "Consecutive S3 failures that open the circuit breaker (requests are skipped).", metavar="N"
    ),
    ("s3", "breaker_cooldown_s"): _Meta(
        "Seconds the breaker stays open before S3 is tried again.", metavar="SECONDS"
    ),
    ("s3", "exists_ttl_s"): _Meta("Seconds a cached 'object exists' answer is trusted.", metavar="SECONDS"),
    ("s3", "missing_ttl_s"): _Meta("Seconds a cached 'object missing' answer is trusted.", metavar="SECONDS"),
    ("s3", "compress"): _Meta("Compress S3 objects with zstd."),
    ("s3", "lease_ttl_s"): _Meta("Seconds an unreleased S3 read lease lives.", metavar="SECONDS"),
    ("s3", "reservation_ttl_s"): _Meta("Seconds an uncommitted S3 upload lives.", metavar="SECONDS"),
    ("s3", "create_bucket"): _Meta("Create the bucket at start-up if it does not exist."),
    # engine
    ("engine", "l3_write_policy"): _Meta(
        "When chunks go to S3: through (after disk, asynchronously) or back (when evicted from disk; "
        "needs the disk tier)."
    ),
    ("engine", "write_queue_depth"): _Meta(
        "Bound of each write-through queue; a full queue drops (and counts) the write.", metavar="N"
    ),
    ("engine", "promote_workers"): _Meta("Threads promoting lower-tier hits into L1.", metavar="N"),
    ("engine", "write_workers"): _Meta("Threads per write-through queue.", metavar="N"),
}


@dataclass(frozen=True, slots=True)
class Option:
    """One setting, and every name it goes by.

    ``key`` is its TOML key (``"l1.size_gb"`` means ``size_gb`` in the ``[l1]`` table; top-level keys
    have no dot). ``kind`` is the value's base type (``int``, ``float``, ``bool``, ``str``, ``Path``,
    an enum, or ``tuple`` for the tier list); ``unit`` converts a decimal number of GiB/MiB to the
    field's bytes.
    """

    key: str
    section: str
    field: str
    flag: str
    env: str
    kind: type
    optional: bool
    unit: Unit | None
    default: Any  # in user units; None when there is none
    default_text: str
    help: str
    metavar: str | None
    secret: bool

    @property
    def toml_table(self) -> str:
        """The TOML table it lives in (``""`` for the top level)."""
        return self.key.rpartition(".")[0]

    @property
    def toml_name(self) -> str:
        return self.key.rpartition(".")[2]

    @property
    def dest(self) -> str:
        """The argparse destination for its flag."""
        return self.key.replace(".", "__")

    @property
    def choices(self) -> tuple[str, ...] | None:
        if isinstance(self.kind, type) and issubclass(self.kind, enum.Enum):
            return tuple(str(m.value) for m in self.kind)  # type: ignore[var-annotated]
        return None

    def to_field(self, value: Any) -> Any:
        """A parsed user value → the dataclass field's value (GiB → bytes)."""
        if self.unit is not None and value is not None:
            return round(value * self.unit.factor)
        return value


def _format_default(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _base_type(annotation: Any) -> tuple[type, bool]:
    """``int | None`` → ``(int, True)``; ``tuple[str, ...]`` → ``(tuple, False)``."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin is tuple:
        return tuple, False
    if args and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return inner, True
    return annotation, False


def _options_of(section: str, cls: type, prefix: str, skip: frozenset[str] = frozenset()) -> Iterator[Option]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        meta = _META.get((section, f.name))
        if meta is None:
            raise RuntimeError(  # a programming error caught by the test suite, not a user error
                f"{cls.__name__}.{f.name} has no entry in tiercache.settings._META; document it there"
            )
        name = meta.name or f.name
        flag = meta.flag or f"--{prefix}{name.replace('_', '-')}"
        kind, optional = _base_type(hints[f.name])
        if meta.unit is not None:
            kind = float  # sizes take decimals (0.5 GiB); to_field rounds to whole bytes
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        if meta.unit is not None and isinstance(default, int):
            default = default / meta.unit.factor
        text = meta.default_text or ("none" if default is None else _format_default(default))
        yield Option(
            key=f"{section}.{name}" if section else name,
            section=section,
            field=f.name,
            flag=flag,
            env=ENV_PREFIX + flag[2:].upper().replace("-", "_"),
            kind=kind,
            optional=optional,
            unit=meta.unit,
            default=default,
            default_text=text,
            help=meta.help,
            metavar=meta.metavar,
            secret=meta.secret,
        )


# -- parsing values --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a value came from, for error messages: a flag, a variable or a file key."""

    kind: str  # "flag" | "env" | "file"
    name: str  # "--l1-size-gb", "TIERCACHE_L1_SIZE_GB", "l1.size_gb"
    path: Path | None = None

    def show(self, raw: Any, secret: bool = False) -> str:
        """``--x 5``, ``TIERCACHE_X=5``, or ``x = 5 in FILE``; secrets as ``***``."""
        value = "***" if secret else (raw if isinstance(raw, str) else repr(raw))
        if self.kind == "flag":
            return f"{self.name} {value}"
        if self.kind == "env":
            return f"{self.name}={value}"
        return f"{self.name} = {value!r} in {self.path}" if not secret else f"{self.name} in {self.path}"

    def label(self) -> str:
        """The name alone: ``--x``, ``TIERCACHE_X``, or ``x (in FILE)``."""
        return self.name if self.kind != "file" else f"{self.name} (in {self.path})"


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(raw: Any) -> bool | None:
    """``raw`` as a boolean: a bool, or true/false, 1/0, yes/no, on/off in any case (and the ints 1
    and 0); ``None`` for anything else, so each caller words its own error."""
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower() if isinstance(raw, str | int) else ""
    return True if text in _TRUE else False if text in _FALSE else None


def _parse_value(opt: Option, raw: Any, origin: Origin) -> Any:
    """Turn a flag/env string or a TOML value into ``opt``'s user-unit value, or raise ConfigError."""
    where = origin.show(raw, opt.secret)

    def fail(what: str, fix: str) -> ConfigError:
        return ConfigError(f"{where} is not {what}; {fix}")

    kind = opt.kind
    if kind is tuple:
        if not isinstance(raw, str | list):
            raise fail("a tier list", "use e.g. l1,disk,s3")
        return parse_server_tiers(raw, origin.label())
    if kind is bool:
        value = parse_bool(raw) if isinstance(raw, bool | str) else None
        if value is None:
            raise fail("a boolean", "use true or false (or 1/0, yes/no, on/off)")
        return value
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        choices = opt.choices or ()
        text = raw.strip().lower() if isinstance(raw, str) else raw
        if text not in choices:
            raise fail("a valid choice", f"use one of {', '.join(choices)}")
        return kind(text)
    if kind is int:
        if isinstance(raw, bool) or not isinstance(raw, int | str):
            raise fail("an integer", f"use a whole number, e.g. {_format_default(opt.default or 1)}")
        try:
            value: Any = int(raw)
        except ValueError:
            raise fail("an integer", f"use a whole number, e.g. {_format_default(opt.default or 1)}") from None
    elif kind is float:
        if isinstance(raw, bool) or not isinstance(raw, int | float | str):
            raise fail("a number", f"use a decimal number, e.g. {_format_default(opt.default or 1)}")
        try:
            value = float(raw)
        except ValueError:
            raise fail("a number", f"use a decimal number, e.g. {_format_default(opt.default or 1)}") from None
        if not math.isfinite(value):
            raise fail("a finite number", f"use a decimal number, e.g. {_format_default(opt.default or 1)}")
    elif kind is str or kind is Path:
        if not isinstance(raw, str):
            raise fail("a string", "quote the value")
        return kind(raw) if kind is Path else raw
    else:  # pragma: no cover - the table only holds the kinds above
        raise RuntimeError(f"no parser for {opt.key} of type {kind!r}")
    if opt.unit is not None and not value > 0:
        raise ConfigError(
            f"{where} is not a positive size; give a number of {opt.unit.label} > 0, e.g. 0.5"
        )
    return value


def _nearest(name: str, candidates: list[str]) -> str:
    found = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    if not found:  # flat keys such as l1_size_gb: compare with the dots taken out
        flat = {c.replace(".", "_"): c for c in candidates}
        hit = difflib.get_close_matches(name.replace(".", "_"), list(flat), n=1, cutoff=0.5)
        found = [flat[hit[0]]] if hit else []
    return f"; did you mean {_show_key(found[0])}?" if found else ""


def _show_key(key: str) -> str:
    table, _, name = key.rpartition(".")
    return f"[{table}] {name}" if table else name


def _read_config_file(path: Path, options: Mapping[str, Option]) -> dict[str, tuple[Any, Origin]]:
    """Read a TOML config file into ``{option key: (value, origin)}``; unknown keys are errors."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; fix --config / {CONFIG_ENV}") from None
    except OSError as exc:
        raise ConfigError(
            f"cannot read config file {path}: {exc.strerror}; check its permissions, or fix --config / {CONFIG_ENV}"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}; fix the syntax") from None
    sections = {s for s, _, _ in _SECTIONS}
    found: dict[str, tuple[Any, Origin]] = {}
    for name, value in data.items():
        if isinstance(value, dict) and name in sections:
            for sub, subvalue in value.items():
                key = f"{name}.{sub}"
                found[key] = (subvalue, Origin("file", key, path))
        else:
            found[name] = (value, Origin("file", name, path))
    for key in found:
        if key not in options:
            raise ConfigError(
                f"config file {path}: unknown key {_show_key(key)}{_nearest(key, list(options))} "
                "(see docs/configuration.md)"
            )
    return found


# -- the config object -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything ``tiercache server`` runs with: which tiers, each part's settings, logging.

    Build it from flags, environment and file with :meth:`load`, or directly in code. ``disk`` must be
    set exactly when ``"disk"`` is in ``tiers`` (left ``None`` it defaults to the per-user data dir),
    ``s3`` exactly when ``"s3"`` is. Frozen: derive variants with :func:`dataclasses.replace`.
    """

    tiers: tuple[str, ...] = DEFAULT_TIERS
    server: ServerOptions = field(default_factory=ServerOptions)
    l1: L1Config = field(default_factory=L1Config)
    disk: DiskConfig | None = None
    s3: S3Config | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    log_level: LogLevel = LogLevel.INFO
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        tiers = parse_server_tiers(self.tiers)
        object.__setattr__(self, "tiers", tiers)
        object.__setattr__(self, "log_level", LogLevel(self.log_level))
        if "disk" in tiers and self.disk is None:
            object.__setattr__(self, "disk", DiskConfig(path=default_disk_path()))
        if "disk" not in tiers and self.disk is not None:
            raise ConfigError(
                f"disk settings are given but --tiers {','.join(tiers)} has no disk tier; add disk to "
                "--tiers or drop the disk settings"
            )
        if "s3" in tiers and self.s3 is None:
            raise ConfigError(
                f"--tiers {','.join(tiers)} includes s3 but no bucket is set; set --s3-bucket (or "
                "TIERCACHE_S3_BUCKET, or bucket in the [s3] table of the config file)"
            )
        if "s3" not in tiers and self.s3 is not None:
            raise ConfigError(
                f"S3 settings are given but --tiers {','.join(tiers)} has no s3 tier; add s3 to "
                "--tiers (e.g. l1,disk,s3) or drop the S3 settings"
            )
        if self.engine.l3_write_policy is L3WritePolicy.BACK and tiers != TIER_ORDER:
            raise ConfigError(
                f"--l3-write-policy back writes to S3 when chunks leave the disk tier, but --tiers is "
                f"{','.join(tiers)}; use --tiers l1,disk,s3 or --l3-write-policy through"
            )
        if not self.metrics_host:
            raise ConfigError("--metrics-host is empty; use an address such as 127.0.0.1")

    # -- loading ---------------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        flags: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
        config_file: str | Path | None = None,
    ) -> ServerConfig:
        """Merge defaults < config file < environment < flags into a validated config.

        ``flags`` maps option keys (:attr:`Option.key`, e.g. ``"l1.size_gb"``) to the raw flag values;
        ``environ`` defaults to :data:`os.environ` (``TIERCACHE_*``; empty variables count as unset);
        ``config_file`` defaults to ``$TIERCACHE_CONFIG``. Raises :class:`ConfigError` with one line
        naming the source of the offending value and the fix.
        """
        environ = os.environ if environ is None else environ
        options = options_by_key()
        raw: dict[str, tuple[Any, Origin]] = {}
        if config_file is None and environ.get(CONFIG_ENV):
            config_file = environ[CONFIG_ENV]
        if config_file is not None:
            raw.update(_read_config_file(Path(config_file), options))
        for opt in options.values():
            text = environ.get(opt.env)
            if text is not None and text.strip() != "":
                raw[opt.key] = (text, Origin("env", opt.env))
        for key, value in (flags or {}).items():
            if key not in options:
                raise ConfigError(f"unknown option {key!r}{_nearest(key, list(options))}")
            raw[key] = (value, Origin("flag", options[key].flag))
        parsed = {key: _parse_value(options[key], value, origin) for key, (value, origin) in raw.items()}
        origins = {key: origin for key, (_, origin) in raw.items()}
        return cls._assemble(parsed, origins, {k: v for k, (v, _) in raw.items()})

    @classmethod
    def _assemble(
        cls, parsed: dict[str, Any], origins: dict[str, Origin], raw: dict[str, Any]
    ) -> ServerConfig:
        options = options_by_key()
        top = {options[k].field: v for k, v in parsed.items() if options[k].section == ""}
        tiers = top.get("tiers", DEFAULT_TIERS)
        parts: dict[str, Any] = {}
        for section, section_cls, _ in _SECTIONS:
            given = {k: v for k, v in parsed.items() if options[k].section == section}
            if section in TIER_ORDER and section not in tiers:
                if given:
                    key = next(iter(given))
                    raise ConfigError(
                        f"{origins[key].label()} is set but --tiers {','.join(tiers)} has no "
                        f"{section} tier; add {section} to --tiers or remove the setting"
                    )
                continue
            kwargs = {options[k].field: options[k].to_field(v) for k, v in given.items()}
            if section == "disk":
                kwargs.setdefault("path", default_disk_path())
            if section == "s3" and "bucket" not in kwargs:
                continue  # ServerConfig explains that the s3 tier needs a bucket
            try:
                parts[section] = section_cls(**kwargs)
            except ConfigError as exc:
                raise ConfigError(_attribute(str(exc), given, origins, raw, options)) from None
        try:
            return cls(**top, **parts)
        except ConfigError as exc:
            raise ConfigError(_attribute(str(exc), parsed, origins, raw, options)) from None

    # -- using it --------------------------------------------------------------------------------
    def build_engine(self) -> TieredEngine:
        """Create the tiers and the engine; the caller owns (and must close) the engine.

        Checks start-up conditions with one-line errors: ``/dev/shm`` too small
        (:class:`~tiercache.errors.ArenaError`), disk directory not writable
        (:class:`~tiercache.errors.DiskTierError`), bucket unreachable
        (:class:`~tiercache.errors.S3TierError`). Tiers created before a failure are closed again.
        """
        from tiercache.engine import TieredEngine
        from tiercache.l1 import L1Tier

        l1 = L1Tier(self.l1)
        lower: list[Any] = []
        try:
            if self.disk is not None:
                from tiercache.l2_disk import DiskTier

                _check_writable(self.disk.path)
                lower.append(DiskTier(self.disk))
            if self.s3 is not None:
                from tiercache.l3_s3 import S3Tier

                lower.append(S3Tier(self.s3))
            return TieredEngine(l1, lower, self.engine)
        except BaseException:
            for tier in reversed([l1, *lower]):
                tier.close()
            raise

    def describe(self) -> str:
        """A human summary: tiers, where it listens, where it stores, budgets. Never any secret."""
        s = self.server
        if s.listen.startswith("tcp://"):
            auth = "CURVE" if s.curve_secret_key_file else "shared secret"
        else:
            auth = "owner-only socket"
        groups = "separate object groups" if s.separate_object_groups else "one object per chunk"
        lines = [
            f"tiers:   {' -> '.join(self.tiers)}",
            f"listen:  {s.listen} ({auth})",
            f"chunks:  {s.chunk_size} tokens, {groups}",
            f"l1:      {_gib(self.l1.size_bytes)} in /dev/shm/{self.l1.name or '<unique name>'}, "
            f"{self.l1.eviction_policy.value} eviction",
        ]
        if self.disk is not None:
            lines.append(f"disk:    {_gib(self.disk.budget_bytes)} in {self.disk.path}")
        if self.s3 is not None:
            c = self.s3
            where = f"s3://{c.bucket}/{c.prefix}" if c.prefix else f"s3://{c.bucket}"
            extra = ", ".join(
                x for x in (c.endpoint_url and f"endpoint {c.endpoint_url}", c.region and f"region {c.region}") if x
            )
            lines.append(
                f"s3:      {where}{f' ({extra})' if extra else ''}, capacity {_gib(c.capacity_bytes)}, "
                f"write-{self.engine.l3_write_policy.value}"
            )
        metrics = (
            f"http://{self.metrics_host}:{s.metrics_port}/metrics" if s.metrics_port is not None else "off"
        )
        lines.append(f"metrics: {metrics}")
        return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / GiB:g} GiB"


def _check_writable(path: Path) -> None:
    """Create ``path`` (owner-only) and prove a file can be written in it.

    A probe rather than ``os.access``: root passes every permission check, but not a read-only mount.
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise DiskTierError(
            f"the disk tier directory {path} is not writable ({exc.strerror or exc}); fix its "
            "permissions or choose another --disk-path"
        ) from None


def _attribute(
    message: str,
    candidates: Mapping[str, Any],
    origins: Mapping[str, Origin],
    raw: Mapping[str, Any],
    options: Mapping[str, Option],
) -> str:
    """Rewrite a part's validation message to name where the value came from.

    The part configs name their settings by flag (``--listen``) or by a label (``S3 max concurrency``,
    ``disk low watermark``); a value that came from the environment or the file is renamed to that
    source, so the user fixes the right place.
    """
    for key in candidates:
        opt, origin = options[key], origins.get(key)
        if origin is None or origin.kind == "flag":
            continue
        label = re.sub(r" (s|gb|mb)$", "", opt.flag[2:].replace("-", " "))
        if opt.unit is not None:  # the part reports bytes; the user gave GiB/MiB
            label = label.rsplit(" ", 1)[0] if label.endswith((" size", " capacity")) else label
        pattern = re.compile(rf"(?<![\w-]){re.escape(opt.flag)}(?![\w-])|\b{re.escape(label)}\b", re.IGNORECASE)
        if pattern.search(message):
            message = pattern.sub(origin.label(), message, count=1)
    return message


def options() -> tuple[Option, ...]:
    """Every option, top-level ones first, then by part (server, l1, disk, s3, engine)."""
    top = _options_of("", ServerConfig, "", skip=frozenset({"server", "l1", "disk", "s3", "engine"}))
    result = list(top)
    for section, cls, prefix in _SECTIONS:
        result.extend(_options_of(section, cls, prefix))
    return tuple(result)


def options_by_key() -> dict[str, Option]:
    """:func:`options` keyed by :attr:`Option.key`."""
    return {opt.key: opt for opt in options()}


# -- argparse and docs -----------------------------------------------------------------------------

_SECTION_TITLES = {
    "": "general",
    "server": "server (listening, clients, shutdown)",
    "l1": "L1: shared host memory",
    "disk": "L2: disk (LMDB)",
    "s3": "L3: S3 or S3-compatible object store",
    "engine": "engine (moving chunks between tiers)",
}


def add_server_arguments(parser: Any) -> None:
    """Add one flag per option to an :class:`argparse.ArgumentParser`, grouped by part.

    Flags default to ``argparse.SUPPRESS`` so only flags actually given reach the namespace (and win
    over environment and file); values are parsed by :meth:`ServerConfig.load`, so a bad value gets
    the same one-line error wherever it came from.
    """
    import argparse

    groups: dict[str, Any] = {}
    for opt in options():
        group = groups.get(opt.section)
        if group is None:
            group = groups[opt.section] = parser.add_argument_group(_SECTION_TITLES[opt.section])
        if opt.secret:
            default = "none"
        else:
            default = opt.default_text
        helptext = f"{opt.help} (default: {default}; env {opt.env})".replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": opt.dest, "default": argparse.SUPPRESS, "help": helptext}
        if opt.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            choices = opt.choices
            kwargs["metavar"] = "{" + ",".join(choices) + "}" if choices else opt.metavar or opt.field.upper()
        group.add_argument(opt.flag, **kwargs)


def flags_from_namespace(namespace: Any) -> dict[str, Any]:
    """The flags actually given, keyed by option key, for :meth:`ServerConfig.load`."""
    given = vars(namespace)
    return {opt.key: given[opt.dest] for opt in options() if opt.dest in given}


def render_docs() -> str:
    """``docs/configuration.md``, generated from the option table (``tiercache config docs``)."""
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by `tiercache config docs --output docs/configuration.md`; do not edit. -->",
        "",
        "`tiercache server` takes every setting from four places; the first that sets a value wins:",
        "",
        "1. command-line flags,",
        "2. `TIERCACHE_*` environment variables (an empty variable counts as unset),",
        f"3. a TOML file given with `--config FILE` (or `{CONFIG_ENV}=FILE`),",
        "4. the defaults below.",
        "",
        "Sizes are decimal numbers of GiB (or MiB where the name says so): `--l1-size-gb 0.5` is 512 MiB.",
        "Booleans take `--flag` / `--no-flag` on the command line and `true`/`false` (or 1/0, yes/no,",
        "on/off) in the environment. Every invalid value is reported in one line naming the flag, variable",
        "or file key it came from; `tiercache server` then exits with status 2. Start-up failures (an",
        "unwritable disk directory, an unreachable bucket, a too small `/dev/shm`) exit with status 1.",
        "",
        "## The config file",
        "",
        "Top-level keys, then one table per part. Unknown keys are errors (with the nearest valid key).",
        "",
        "```toml",
        'tiers = "l1,disk,s3"          # or ["l1", "disk", "s3"]',
        'log_level = "info"',
        "",
        "[server]",
        'listen = "tcp://0.0.0.0:5555" # the secret is better set as TIERCACHE_AUTH_SECRET',
        "chunk_size = 256",
        "",
        "[l1]",
        "size_gb = 16",
        'eviction_policy = "s3fifo"',
        "",
        "[disk]",
        'path = "/nvme/tiercache"',
        "size_gb = 500",
        "",
        "[s3]",
        'bucket = "my-kv-cache"',
        'prefix = "prod"',
        "",
        "[engine]",
        'l3_write_policy = "through"',
        "```",
        "",
        f"`--config FILE` (env `{CONFIG_ENV}`) names the file; there is no default location.",
        "",
        "## Options",
    ]
    section = None
    for opt in options():
        if opt.section != section:
            section = opt.section
            table = f"`[{section}]` table" if section else "top level of the file"
            out += [
                "",
                f"### {_SECTION_TITLES[section][0].upper()}{_SECTION_TITLES[section][1:]}",
                "",
                f"TOML keys go in the {table}.",
                "",
                "| flag | environment | TOML key | default | meaning |",
                "|---|---|---|---|---|",
            ]
        flag = opt.flag if opt.kind is not bool else f"{opt.flag}, --no-{opt.flag[2:]}"
        if opt.choices:
            flag += f" {{{','.join(opt.choices)}}}"
        elif opt.kind is not bool:
            flag += f" {opt.metavar or opt.field.upper()}"
        cells = (f"`{flag}`", f"`{opt.env}`", f"`{opt.toml_name}`", opt.default_text, opt.help)
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    out.append("")
    return "\n".join(out)
