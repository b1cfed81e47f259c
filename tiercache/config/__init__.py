"""Configuration: every part's frozen, validated settings, the option table that maps flags,
``TIERCACHE_*`` variables and TOML keys onto them, and the connector's settings.

* :mod:`~tiercache.config.parts` — one frozen config per part (L1, disk, S3, engine, server);
* :mod:`~tiercache.config.table` and :mod:`~tiercache.config.options` — the option table and the
  parsing of raw values;
* :mod:`~tiercache.config.server` — :class:`ServerConfig` and its loader (flags > env > file);
* :mod:`~tiercache.config.docs` — ``docs/configuration.md`` rendered from the table;
* :mod:`~tiercache.config.connector` — the vLLM connector's ``kv_connector_extra_config``;
* :mod:`~tiercache.config.units` and :mod:`~tiercache.config.values` — sizes, booleans, tier lists.

Importing it is cheap: it depends on nothing of tiercache but the error tree.
"""

from tiercache.config.parts import (
    DiskConfig,
    EngineConfig,
    EvictionPolicyName,
    GeneralOptions,
    L1Config,
    L3Admission,
    L3WritePolicy,
    LogLevel,
    S3Config,
    ServerOptions,
    default_endpoint,
    default_runtime_dir,
)
from tiercache.config.server import ServerConfig, default_data_dir, default_disk_path
from tiercache.config.units import GiB, KiB, MiB

__all__ = [
    "DiskConfig",
    "EngineConfig",
    "EvictionPolicyName",
    "GeneralOptions",
    "GiB",
    "KiB",
    "L1Config",
    "L3Admission",
    "L3WritePolicy",
    "LogLevel",
    "MiB",
    "S3Config",
    "ServerConfig",
    "ServerOptions",
    "default_data_dir",
    "default_disk_path",
    "default_endpoint",
    "default_runtime_dir",
]
