"""The SGLang backend's settings, read from ``--hicache-storage-backend-extra-config``. No SGLang import.

The keys tiercache reads are the vLLM connector's, with the same meaning, defaults and checks
(:mod:`tiercache.config.connector`): ``server``, ``timeout_s``, ``auth_secret_file`` (or ``auth_secret``), ``retry_s`` and
``weights_id``; each may also be spelled ``tiercache.<name>``. SGLang's own keys (``backend_name``,
``module_path``, ``class_name``, ``interface_v1``, ``tp_lcm_size``) pass through untouched. The
connector's vLLM-only keys (``overlap_loads``, ``lookup_wait_s``, ``kv_events_*``,
``inflight_wait_s``) mean nothing here and are refused, so a copied vLLM config does not silently
pretend to work.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tiercache.config.connector import ConnectorSettings
from tiercache.errors import ConfigError

#: The connector keys this backend honours.
SHARED_KEYS = ("server", "timeout_s", "auth_secret_file", "auth_secret", "retry_s", "weights_id")
_VLLM_ONLY = (
    "overlap_loads",
    "inflight_wait_s",
    "lookup_wait_s",
    "kv_events_interval_s",
    "kv_events_chunks",
)
FLAG = "--hicache-storage-backend-extra-config"


@dataclass(frozen=True, slots=True)
class SGLangSettings:
    """Validated settings of one SGLang backend (see the module docstring)."""

    link: ConnectorSettings
    #: SGLang's ``interface_v1``: whether it calls the zero-copy ``batch_get_v1`` / ``batch_set_v1``.
    zero_copy: bool

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> SGLangSettings:
        """Parse SGLang's ``extra_config``; a bad value raises :class:`ConfigError` naming it."""
        extra = dict(extra or {})
        for key in extra:
            name = key.removeprefix("tiercache.")
            if name in _VLLM_ONLY:
                raise ConfigError(
                    f"{FLAG} key {key!r} is a vLLM connector setting with no meaning for SGLang; remove it "
                    f"(the SGLang backend reads {', '.join(SHARED_KEYS)})"
                )
        try:
            link = ConnectorSettings.from_extra_config(extra)
        except ConfigError as exc:
            # The shared parser names vLLM's flag; say which flag the user actually set.
            raise ConfigError(str(exc).replace("kv_connector_extra_config", FLAG)) from exc
        return cls(link=link, zero_copy=_truthy(extra.get("interface_v1", 0)))


def _truthy(value: Any) -> bool:
    # SGLang itself reads interface_v1 with bool(...): "0" is a string and therefore true there.
    return bool(value)
