"""The vLLM connector's settings, read from vLLM's ``kv_connector_extra_config``. No vLLM import here.

Keys (all optional)::

    server        ZMQ endpoint of the tiercache server (default: the server's default ipc socket)
    timeout_s     bound on every round trip to the server, seconds (default 2.0)
    auth_secret   shared secret of a server that requires one (default: $TIERCACHE_AUTH_SECRET)
    retry_s       while the server is unreachable, how often to try again, seconds (default 5.0)
    weights_id    override the weights identity put into the layout fingerprint (default: the
                  model revision, else a content fingerprint of the checkpoint files)
    overlap_loads write loaded pages layer by layer while the forward pass runs (default false;
                  on CUDA, true makes vLLM switch CUDA graphs to PIECEWISE mode)

Keys may also be spelled with a ``tiercache.`` prefix (``tiercache.server``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tiercache.config.values import parse_bool
from tiercache.errors import ConfigError

_KEYS = ("server", "timeout_s", "auth_secret", "retry_s", "weights_id", "overlap_loads")


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """Validated connector settings (see the module docstring for the keys)."""

    server: str | None = None
    timeout_s: float = 2.0
    auth_secret: str | None = field(default=None, repr=False)  # never printed or logged
    retry_s: float = 5.0
    weights_id: str | None = None
    overlap_loads: bool = False

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError(f"kv_connector_extra_config timeout_s={self.timeout_s!r} must be > 0 seconds")
        if not self.retry_s > 0:
            raise ConfigError(f"kv_connector_extra_config retry_s={self.retry_s!r} must be > 0 seconds")
        if self.server is not None and not self.server.startswith(("ipc://", "tcp://")):
            raise ConfigError(
                f"kv_connector_extra_config server={self.server!r} is not a tiercache endpoint; "
                "use ipc:///path/to/server.sock or tcp://HOST:PORT"
            )

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Parse vLLM's ``kv_connector_extra_config``; unknown ``tiercache.*`` keys are an error."""
        raw: dict[str, Any] = {}
        for key, value in (extra or {}).items():
            name = key.removeprefix("tiercache.")
            if name in _KEYS:
                raw[name] = value
            elif key.startswith("tiercache."):
                raise ConfigError(f"unknown kv_connector_extra_config key {key!r}; known: {', '.join(_KEYS)}")
        try:
            return cls(
                server=str(raw["server"]) if raw.get("server") else None,
                timeout_s=float(raw.get("timeout_s", 2.0)),
                auth_secret=str(raw["auth_secret"])
                if raw.get("auth_secret")
                else os.environ.get("TIERCACHE_AUTH_SECRET") or None,
                retry_s=float(raw.get("retry_s", 5.0)),
                weights_id=str(raw["weights_id"]) if raw.get("weights_id") else None,
                overlap_loads=_flag(raw.get("overlap_loads", False)),
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid kv_connector_extra_config for tiercache: {exc}") from exc


def _flag(value: Any) -> bool:
    """A JSON boolean, or the strings true/false/1/0/yes/no/on/off (any case)."""
    flag = parse_bool(value)
    if flag is None:
        raise ValueError(f"overlap_loads={value!r} is not a boolean; use true or false")
    return flag
