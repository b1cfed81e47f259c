"""What importing the SGLang backend loads, in a fresh interpreter: its package and settings stay
free of torch and SGLang (SGLang's factory imports the class only when it loads the backend), and
the backend itself loads nothing of the server side (import contracts check the source; this checks
what Python actually loads)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.test_imports import loaded_after, server_side


def test_the_package_settings_and_keys_stay_light() -> None:
    loaded = loaded_after("import tiercache.sglang, tiercache.sglang.settings, tiercache.sglang.keys")
    assert sorted(m for m in loaded if m.split(".")[0] in ("torch", "sglang", "zmq")) == []
    assert server_side(loaded) == []


def test_the_backend_loads_nothing_of_the_server_side() -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("the backend class needs sglang (CI runs this in .venv-sglang)")
    loaded = loaded_after("from tiercache.sglang import TierCacheStorage")
    assert "sglang.srt.mem_cache.hicache_storage" in loaded
    assert server_side(loaded) == []
