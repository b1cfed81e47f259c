"""The vLLM connector plugin: ``TierCacheConnector`` (scheduler half, worker half, layout discovery).

Point vLLM at it with::

    --kv-transfer-config '{"kv_connector": "TierCacheConnector",
                           "kv_connector_module_path": "tiercache.connector", "kv_role": "kv_both"}'

Importing this package is cheap: vLLM and torch are imported only when ``TierCacheConnector`` is
first accessed (vLLM does that when it builds the connector). The settings and the weights identity
(:mod:`tiercache.config.connector`, :mod:`tiercache.keys.weights`) work without vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiercache.connector.connector import TierCacheConnector

__all__ = ["TierCacheConnector"]


def __getattr__(name: str) -> Any:
    if name == "TierCacheConnector":
        from tiercache.connector.connector import TierCacheConnector

        return TierCacheConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
