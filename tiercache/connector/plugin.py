"""vLLM general plugin: registers ``TierCacheConnector`` by name with vLLM's connector factory.

With the entry point installed (``[project.entry-points."vllm.general_plugins"]`` →
``tiercache = "tiercache.connector.plugin:register"``) vLLM calls :func:`register` in every process it
starts, so ``--kv-transfer-config '{"kv_connector": "TierCacheConnector", "kv_role": "kv_both"}'``
works without ``kv_connector_module_path``. vLLM may load plugins several times per process; a second
call is a no-op. The connector module itself is imported lazily, when vLLM builds the connector.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

CONNECTOR_NAME = "TierCacheConnector"


def register() -> None:
    """Register the connector with vLLM's ``KVConnectorFactory`` (idempotent)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError as exc:  # vLLM absent or incompatible: nothing to register with
        log.debug("tiercache: vLLM connector factory unavailable: %s", exc)
        return
    registry = getattr(KVConnectorFactory, "_registry", None)
    if isinstance(registry, dict) and CONNECTOR_NAME in registry:
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "tiercache.connector", CONNECTOR_NAME)
    except ValueError:  # registered meanwhile (another plugin load in this process)
        pass
