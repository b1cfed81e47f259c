"""The vLLM connector's settings, read from vLLM's ``kv_connector_extra_config``. No vLLM import here.

Keys (all optional)::

    server        endpoint of the tiercache server (default: the server's default socket)
    timeout_s     bound on every round trip to the server, seconds (default 2.0)
    auth_secret_file
                  a file holding the shared secret of a server that requires one (read at start;
                  default: $TIERCACHE_AUTH_SECRET)
    auth_secret   the secret itself: avoid it, vLLM prints kv_connector_extra_config at start-up
                  and it is on the engine's command line (a warning says so)
    retry_s       the longest pause between reconnect attempts, seconds (default 5.0); pauses start
                  at 0.5 s and double while the link keeps failing. A server that does not answer
                  at all is listened for without pauses (on unix://, the default, a connect
                  every 0.1 s while nothing listens; on ipc:// and tcp://, a ping waits for it),
                  so it is found as soon as it is back
    weights_id    override the weights identity put into the layout fingerprint (default: the
                  model revision, else a content fingerprint of the checkpoint files)
    overlap_loads write loaded pages layer by layer while the forward pass runs (default false;
                  on CUDA, true makes vLLM switch CUDA graphs to PIECEWISE mode)
    lookup_wait_s how long the scheduler waits, on the engine thread, for a lookup's reply in the
                  step that sends it; a reply that comes later is collected at the next step
                  (vLLM then schedules the request one step later), seconds; 0 never waits
                  (default 0.005)
    inflight_wait_s
                  how long a lookup waits for chunks another engine is still storing (reserved on
                  the server, not yet committed: a prefill engine's stores when its decode engine
                  asks), seconds; 0 reports them as misses (default 2.0)
    kv_events_interval_s
                  with vLLM's ``--kv-events-config`` on, how often the connector asks the server which
                  tiers gained or lost the chunks it stored, to publish them as KV events; seconds,
                  0 publishes none (default 0.5)
    kv_events_chunks
                  how many chunks' worth of stored blocks the connector remembers for those events
                  (a tail counts its blocks; their token ids and block hashes, about 14 bytes per
                  token); the oldest beyond it are published as removed and forgotten (default 16384)
    kv_events_endpoint, kv_events_replay_endpoint
                  give both to publish those events on a feed of tiercache's own instead of vLLM's
                  stream (ZMQ addresses to bind, e.g. tcp://*:5560 and tcp://*:5561): vLLM's framing,
                  plus a snapshot of what the tiers hold for a router that (re)starts
                  (:mod:`tiercache.connector.feed`); needs no ``--kv-events-config`` (default: none)
    kv_events_buffer_batches
                  how many of the feed's latest batches it keeps to replay (default 10000)
    tails         also store what lies past a request's last full chunk (its prompt's and, at its
                  end, its answer's full blocks of the last chunk, as one object) and match block
                  by block, so a hit ends where vLLM's own prefix cache would end (default true;
                  off, with a log line, for recurrent-state models and groups of different block
                  sizes; false stores and matches whole chunks only)

Keys may also be spelled with a ``tiercache.`` prefix (``tiercache.server``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiercache.config.values import parse_bool, read_secret_file
from tiercache.errors import ConfigError

_KEYS = (
    "server",
    "timeout_s",
    "auth_secret",
    "auth_secret_file",
    "retry_s",
    "weights_id",
    "overlap_loads",
    "inflight_wait_s",
    "lookup_wait_s",
    "kv_events_interval_s",
    "kv_events_chunks",
    "kv_events_endpoint",
    "kv_events_replay_endpoint",
    "kv_events_buffer_batches",
    "tails",
)
log = logging.getLogger(__name__)

#: The server refuses a longer wait (it pins L1 for the waiting lookup meanwhile).
MAX_INFLIGHT_WAIT_S = 60.0


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """Validated connector settings (see the module docstring for the keys)."""

    server: str | None = None
    timeout_s: float = 2.0
    auth_secret: str | None = field(default=None, repr=False)  # never printed or logged
    retry_s: float = 5.0
    weights_id: str | None = None
    overlap_loads: bool = False
    inflight_wait_s: float = 2.0
    lookup_wait_s: float = 0.005
    kv_events_interval_s: float = 0.5
    kv_events_chunks: int = 16384
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_buffer_batches: int = 10_000
    tails: bool = True

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError(f"kv_connector_extra_config timeout_s={self.timeout_s!r} must be > 0 seconds")
        if not self.retry_s > 0:
            raise ConfigError(f"kv_connector_extra_config retry_s={self.retry_s!r} must be > 0 seconds")
        if not 0 <= self.inflight_wait_s <= MAX_INFLIGHT_WAIT_S:
            raise ConfigError(
                f"kv_connector_extra_config inflight_wait_s={self.inflight_wait_s!r} must be 0 to "
                f"{MAX_INFLIGHT_WAIT_S:g} seconds (0: never wait for chunks still being stored)"
            )
        if not 0 <= self.lookup_wait_s <= self.timeout_s:
            raise ConfigError(
                f"kv_connector_extra_config lookup_wait_s={self.lookup_wait_s!r} must be 0 to timeout_s "
                f"({self.timeout_s:g}) seconds (0: collect every lookup's reply at the next step)"
            )
        if not self.kv_events_interval_s >= 0:
            raise ConfigError(
                f"kv_connector_extra_config kv_events_interval_s={self.kv_events_interval_s!r} must be >= 0 "
                "seconds (0: publish no KV events)"
            )
        if self.kv_events_chunks < 1:
            raise ConfigError(
                f"kv_connector_extra_config kv_events_chunks={self.kv_events_chunks!r} must be at least 1"
            )
        if (self.kv_events_endpoint is None) != (self.kv_events_replay_endpoint is None):
            raise ConfigError(
                "kv_connector_extra_config needs kv_events_endpoint and kv_events_replay_endpoint together "
                "(the feed's live events, and the replays and snapshots a router catches up with)"
            )
        if self.kv_events_buffer_batches < 1:
            raise ConfigError(
                f"kv_connector_extra_config kv_events_buffer_batches={self.kv_events_buffer_batches!r} must be "
                "at least 1"
            )
        if self.server is not None and not self.server.startswith(("ipc://", "unix://", "tcp://")):
            raise ConfigError(
                f"kv_connector_extra_config server={self.server!r} is not a tiercache endpoint; "
                "use ipc:///path/to/server.sock, unix:///path/to/server.sock or tcp://HOST:PORT"
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
                timeout_s=_seconds(raw, "timeout_s", 2.0),
                auth_secret=_secret(raw),
                retry_s=_seconds(raw, "retry_s", 5.0),
                weights_id=str(raw["weights_id"]) if raw.get("weights_id") else None,
                overlap_loads=_flag(raw.get("overlap_loads", False)),
                inflight_wait_s=_seconds(raw, "inflight_wait_s", 2.0),
                lookup_wait_s=_seconds(raw, "lookup_wait_s", 0.005),
                kv_events_interval_s=_seconds(raw, "kv_events_interval_s", 0.5),
                kv_events_chunks=_count(raw, "kv_events_chunks", 16384),
                kv_events_endpoint=str(raw["kv_events_endpoint"]) if raw.get("kv_events_endpoint") else None,
                kv_events_replay_endpoint=(
                    str(raw["kv_events_replay_endpoint"]) if raw.get("kv_events_replay_endpoint") else None
                ),
                kv_events_buffer_batches=_count(raw, "kv_events_buffer_batches", 10_000),
                tails=_flag(raw.get("tails", True)),
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid kv_connector_extra_config for tiercache: {exc}") from exc


def _secret(raw: Mapping[str, Any]) -> str | None:
    """The shared secret: ``auth_secret`` (warned about: vLLM logs its extra config), else the
    first line of ``auth_secret_file``, else ``$TIERCACHE_AUTH_SECRET``."""
    if raw.get("auth_secret"):
        log.warning(
            "tiercache: auth_secret is given inline in kv_connector_extra_config, which vLLM prints at "
            "start-up and which is on the engine's command line; put it in a file of mode 0600 and name it "
            "with auth_secret_file, or set TIERCACHE_AUTH_SECRET"
        )
        return str(raw["auth_secret"])
    if raw.get("auth_secret_file"):
        return read_secret_file(Path(str(raw["auth_secret_file"])))
    return os.environ.get("TIERCACHE_AUTH_SECRET") or None


def _seconds(raw: Mapping[str, Any], key: str, default: float) -> float:
    """``raw[key]`` as seconds (a number or a numeric string), naming the key when it is not."""
    value = raw.get(key, default)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}={value!r} is not a number of seconds") from None


def _count(raw: Mapping[str, Any], key: str, default: int) -> int:
    """``raw[key]`` as a whole number (an int or a numeric string), naming the key when it is not."""
    value = raw.get(key, default)
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{key}={value!r} is not a whole number")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}={value!r} is not a whole number") from None


def _flag(value: Any) -> bool:
    """A JSON boolean, or the strings true/false/1/0/yes/no/on/off (any case)."""
    flag = parse_bool(value)
    if flag is None:
        raise ValueError(f"overlap_loads={value!r} is not a boolean; use true or false")
    return flag
