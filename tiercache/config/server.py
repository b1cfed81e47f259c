"""The server's whole configuration: one frozen, validated :class:`ServerConfig`, and its loader.

:class:`ServerConfig` composes the part configs of :mod:`tiercache.config.parts` (it does not
re-declare their fields). :meth:`ServerConfig.load` reads every way of setting a value, all driven by
the option table (:mod:`tiercache.config.table`):

* ``tiercache server`` flags (:mod:`tiercache.cli.server`),
* ``TIERCACHE_*`` environment variables,
* an optional TOML file (``--config FILE`` or ``TIERCACHE_CONFIG``) with one table per part::

      tiers = "l1,disk,s3"      # top-level: tiers, log_level, metrics_host
      [server]                  # listen, chunk_size, auth_secret, ...
      [l1]                      # size_gb, name, eviction_policy, ...
      [disk]                    # path, size_gb, ...
      [s3]                      # bucket, prefix, endpoint_url, ...
      [engine]                  # l3_write_policy, ...

Precedence: flags > environment > file > defaults. Every error is one line naming where the value came
from (the flag, the variable or the file key), the value (never a secret) and the fix: a part that
refuses a field raises :class:`~tiercache.errors.SettingError`, which the loader relabels with the
place the value came from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiercache.config.options import (
    CONFIG_ENV,
    Option,
    Origin,
    nearest,
    parse_value,
    read_config_file,
)
from tiercache.config.parts import (
    DiskConfig,
    EngineConfig,
    GeneralOptions,
    L1Config,
    L3Admission,
    L3WritePolicy,
    LogLevel,
    S3Config,
    ServerOptions,
)
from tiercache.config.table import SECTIONS, options_by_key
from tiercache.config.units import GiB
from tiercache.config.values import TIER_ORDER
from tiercache.errors import ConfigError, SettingError


def default_data_dir() -> Path:
    """The per-user data directory: ``$XDG_DATA_HOME/tiercache`` or ``~/.local/share/tiercache``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "tiercache"


def default_disk_path() -> Path:
    """Where the disk tier lives unless told otherwise: ``<per-user data dir>/disk``."""
    return default_data_dir() / "disk"


# Not slots: a frozen slots dataclass raises TypeError instead of FrozenInstanceError when one
# assigns a property (tiers, log_level, metrics_host) in Python 3.11.
@dataclass(frozen=True)
class ServerConfig:
    """Everything ``tiercache server`` runs with: which tiers, each part's settings, logging.

    Build it from flags, environment and file with :meth:`load`, or directly in code. ``disk`` must be
    set exactly when ``"disk"`` is in ``tiers`` (left ``None`` it defaults to the per-user data dir),
    ``s3`` exactly when ``"s3"`` is. Frozen: derive variants with :func:`dataclasses.replace`.
    """

    general: GeneralOptions = field(default_factory=GeneralOptions)
    server: ServerOptions = field(default_factory=ServerOptions)
    l1: L1Config = field(default_factory=L1Config)
    disk: DiskConfig | None = None
    s3: S3Config | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        tiers = self.tiers
        if "disk" in tiers and self.disk is None:
            object.__setattr__(self, "disk", DiskConfig(path=default_disk_path()))
        if "disk" not in tiers and self.disk is not None:
            raise ConfigError(
                f"disk settings are given but --tiers {','.join(tiers)} has no disk tier; add disk to "
                "--tiers or drop the disk settings"
            )
        if "s3" in tiers and self.s3 is None:
            raise SettingError(
                "tiers",
                "--tiers",
                f"{','.join(tiers)} includes s3 but no bucket is set; set --s3-bucket (or "
                "TIERCACHE_S3_BUCKET, or bucket in the [s3] table of the config file)",
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
        if self.engine.l3_admission is L3Admission.READ and tiers != TIER_ORDER:
            raise ConfigError(
                f"--l3-admission read writes a chunk to S3 once it was read while on the disk tier, but "
                f"--tiers is {','.join(tiers)}; use --tiers l1,disk,s3 or --l3-admission all"
            )

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers to run, fastest first."""
        return self.general.tiers

    @property
    def log_level(self) -> LogLevel:
        return self.general.log_level

    @property
    def metrics_host(self) -> str:
        return self.general.metrics_host

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
            raw.update(read_config_file(Path(config_file), options))
        for opt in options.values():
            text = environ.get(opt.env)
            if text is not None and text.strip() != "":
                raw[opt.key] = (text, Origin("env", opt.env))
        for key, value in (flags or {}).items():
            if key not in options:
                raise ConfigError(f"unknown option {key!r}{nearest(key, list(options))}")
            raw[key] = (value, Origin("flag", options[key].flag))
        parsed = {key: parse_value(options[key], value, origin) for key, (value, origin) in raw.items()}
        return cls._assemble(parsed, {key: origin for key, (_, origin) in raw.items()}, options)

    @classmethod
    def _assemble(
        cls, parsed: dict[str, Any], origins: dict[str, Origin], options: Mapping[str, Option]
    ) -> ServerConfig:
        parts: dict[str, Any] = {}
        for section, section_cls, _ in SECTIONS:
            given = {k: v for k, v in parsed.items() if options[k].section == section}
            tiers = parts["general"].tiers if "general" in parts else ()
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
                parts[section or "general"] = section_cls(**kwargs)
            except SettingError as exc:
                raise _relabelled(exc, section, parsed, origins, options) from None
        try:
            return cls(**parts)
        except SettingError as exc:  # about the tiers, a top-level setting
            raise _relabelled(exc, "", parsed, origins, options) from None

    # -- using it --------------------------------------------------------------------------------
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
                x
                for x in (c.endpoint_url and f"endpoint {c.endpoint_url}", c.region and f"region {c.region}")
                if x
            )
            lines.append(
                f"s3:      {where}{f' ({extra})' if extra else ''}, capacity {_gib(c.capacity_bytes)}, "
                f"write-{self.engine.l3_write_policy.value}, admission {self.engine.l3_admission.value}"
            )
        metrics = (
            f"http://{self.metrics_host}:{s.metrics_port}/metrics" if s.metrics_port is not None else "off"
        )
        lines.append(f"metrics: {metrics}")
        return "\n".join(lines)


def _gib(n: int) -> str:
    """A size configured in GiB, as given (``0.5 GiB``, ``100 GiB``)."""
    return f"{n / GiB:g} GiB"


def _relabelled(
    exc: SettingError,
    section: str,
    parsed: Mapping[str, Any],
    origins: Mapping[str, Origin],
    options: Mapping[str, Option],
) -> SettingError:
    """``exc`` (raised by ``section``'s config) naming the flag, variable or file key its field's
    value came from; unchanged if the user did not set that field."""
    key = next((k for k in parsed if options[k].field == exc.field and options[k].section == section), None)
    if key is None or key not in origins:
        return exc
    return exc.relabel(origins[key].label())
