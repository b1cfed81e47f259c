"""How vLLM finds and starts the connector: the general plugin (:mod:`tiercache.connector.plugin`)
that registers ``TierCacheConnector`` and its entry point, and what the connector class
(:mod:`tiercache.connector.connector`) says and asks at start-up: its role's line, vLLM's log
handlers for its lines, PIECEWISE CUDA graphs only for overlapped loads.

Tests that need vLLM skip without it; the plugin's own tests run anywhere."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest


def test_plugin_registration_is_idempotent() -> None:
    from tiercache.connector import plugin

    plugin.register()
    plugin.register()  # vLLM may load general plugins more than once per process
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        return  # no vLLM here: register() is a no-op
    assert plugin.CONNECTOR_NAME in KVConnectorFactory._registry
    from tiercache.connector.connector import TierCacheConnector

    assert KVConnectorFactory._registry[plugin.CONNECTOR_NAME]() is TierCacheConnector


def test_the_vllm_plugin_entry_point_is_installed() -> None:
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.value == "tiercache.connector.plugin:register" for ep in plugins)


@pytest.mark.parametrize(
    ("role", "words"),
    [("kv_producer", "never loads"), ("kv_consumer", "never stores"), ("kv_both", "loads what")],
)
def test_the_start_up_line_says_what_the_role_does(role: str, words: str) -> None:
    pytest.importorskip("vllm")
    from tiercache.connector.connector import describe_role

    assert role in describe_role(role) and words in describe_role(role)


class _Lines(logging.Handler):
    """Keeps the message of every record it handles."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage())


def test_the_connectors_lines_go_through_vllms_log_handlers() -> None:
    pytest.importorskip("vllm")
    from tiercache.connector.connector import adopt_log_handlers

    theirs, ours = logging.getLogger("test-vllm-like"), logging.getLogger("test-tiercache-like")
    handler = _Lines()
    theirs.addHandler(handler)
    theirs.setLevel(logging.INFO)
    try:
        adopt_log_handlers(ours, theirs)
        adopt_log_handlers(ours, theirs)  # idempotent: one handler, one line
        ours.getChild("connector").info("tiercache: connected")
        ours.getChild("connector").debug("not at INFO")
        assert handler.seen == ["tiercache: connected"]
        assert not ours.propagate
    finally:
        theirs.removeHandler(handler)
        ours.handlers.clear()
        ours.propagate = True
        ours.setLevel(logging.NOTSET)


def test_only_explicitly_overlapped_loads_ask_vllm_for_piecewise_cuda_graphs() -> None:
    """Per-layer waits cannot run inside a FULL CUDA graph; the default (no overlap) keeps vLLM's
    CUDA graph mode."""
    pytest.importorskip("vllm")
    from tiercache.connector import TierCacheConnector

    assert TierCacheConnector.requires_piecewise_for_cudagraph({"overlap_loads": True}) is True
    assert TierCacheConnector.requires_piecewise_for_cudagraph({}) is False
    assert TierCacheConnector.requires_piecewise_for_cudagraph({"overlap_loads": False}) is False
