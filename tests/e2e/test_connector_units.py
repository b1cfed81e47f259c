"""Connector pieces that need no vLLM: settings, weights identity, block-size validation, imports.

These run in every environment (the project's own CI has no vLLM); ``test_dense.py`` runs the engine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiercache.connector.identity import content_fingerprint, weights_identity
from tiercache.connector.layout import check_block_sizes
from tiercache.connector.settings import ConnectorSettings
from tiercache.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_settings_defaults_and_prefixed_keys() -> None:
    s = ConnectorSettings.from_extra_config({})
    assert (s.server, s.timeout_s, s.retry_s) == (None, 2.0, 5.0)
    s = ConnectorSettings.from_extra_config({"tiercache.server": "ipc:///x.sock", "timeout_s": "0.5", "other": 1})
    assert (s.server, s.timeout_s) == ("ipc:///x.sock", 0.5)


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"server": "localhost:5600"}, "ipc://"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"tiercache.chunk_size": 256}, "unknown"),
    ],
)
def test_settings_errors_name_the_key(extra: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        ConnectorSettings.from_extra_config(extra)


def test_auth_secret_is_never_printed() -> None:
    s = ConnectorSettings.from_extra_config({"auth_secret": "hunter2"})
    assert s.auth_secret == "hunter2" and "hunter2" not in repr(s)


def test_chunk_size_error_states_both_sizes_and_the_fix() -> None:
    check_block_sizes(128, 32, [32])
    with pytest.raises(ConfigError) as err:
        check_block_sizes(48, 32, [32])
    msg = str(err.value)
    assert "--chunk-size 48" in msg and "block size 32" in msg and "--chunk-size 32 or a multiple" in msg


def _checkpoint(d: Path, payload: bytes) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(payload)
    return d


def test_weights_identity_follows_the_weights_not_the_path(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "m", b"A" * 3_000_000)
    first = weights_identity(str(model))
    assert first.startswith("files:") and weights_identity(str(model)) == first
    (model / "model.safetensors").write_bytes(b"B" * 3_000_000)  # other weights, same path and size
    assert weights_identity(str(model)) != first
    assert weights_identity(str(model), override="my-build-7") == "id:my-build-7"


def test_weights_identity_without_files_uses_the_revision(tmp_path: Path) -> None:
    assert content_fingerprint(tmp_path) is None
    assert weights_identity("org/not-a-cached-model-xyz", revision="abc123") == "rev:abc123"


def test_importing_the_connector_package_stays_light() -> None:
    code = (
        "import sys, tiercache, tiercache.connector, tiercache.connector.settings, tiercache.connector.identity; "
        "heavy = [m for m in ('vllm', 'torch') if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- KV-cache group kinds (fake spec objects: only the class names and fields matter) -----------------


def _fake_spec(cls_name: str, block_size: int = 32, **fields: object) -> object:
    return type(cls_name, (), {"block_size": block_size, **fields})()


def test_full_and_sliding_groups_are_accepted() -> None:
    from tiercache.connector.layout import check_group_specs

    check_group_specs([_fake_spec("SlidingWindowSpec", sliding_window=64), _fake_spec("FullAttentionSpec")])


@pytest.mark.parametrize(
    "spec, words",
    [
        (_fake_spec("MambaSpec"), "recurrent"),
        (_fake_spec("ChunkedLocalAttentionSpec", attention_chunk_size=64), "not supported"),
        (_fake_spec("SlidingWindowSpec", sliding_window=64, extra_retained_tokens=3), "extra retained"),
    ],
)
def test_unsupported_groups_fail_with_a_clear_error(spec: object, words: str) -> None:
    from tiercache.connector.layout import check_group_specs

    with pytest.raises(ConfigError, match=words):
        check_group_specs([_fake_spec("FullAttentionSpec"), spec])


def test_sliding_group_needs_only_its_trailing_window_chunks() -> None:
    from tiercache.connector.layout import GroupLayout

    def group(window: int) -> GroupLayout:
        return GroupLayout(0, 0, 0, ("l0",), 32, 2, 8192, None, window_tokens=window)  # type: ignore[arg-type]

    assert list(group(0).needed_chunks(3, 64)) == [0, 1, 2]
    assert list(group(64).needed_chunks(3, 64)) == [2]
    assert list(group(65).needed_chunks(3, 64)) == [1, 2]  # ceil(65 / 64) = 2 chunks
    assert list(group(4096).needed_chunks(3, 64)) == [0, 1, 2]


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


# -- start-up rules for recurrent (Mamba/GDN) groups ------------------------------------------------


def _recurrent(**kw: object) -> list[str]:
    from tiercache.connector.layout import check_recurrent_config

    args: dict[str, object] = {
        "mamba_cache_mode": "align", "enable_prefix_caching": True, "max_num_batched_tokens": 768,
        "block_size": 384, "chunk_size": 384, "separate_object_groups": True,
    }
    args.update(kw)
    return check_recurrent_config(**args)  # type: ignore[arg-type]


def test_recurrent_config_that_works() -> None:
    assert _recurrent() == ["recurrent state exists only every 768 tokens (prefill step), so hits are multiples of 768 tokens, not of the chunk size 384"]
    assert _recurrent(max_num_batched_tokens=384) == []
    assert _recurrent(max_num_batched_tokens=800, chunk_size=768) == []  # steps of 768 (whole blocks)
    assert _recurrent(max_num_batched_tokens=384, separate_object_groups=False, chunk_size=768) == []


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"mamba_cache_mode": "none"}, "mamba_cache_mode=\"align\""),
        ({"mamba_cache_mode": None}, "--mamba-cache-mode align"),
        ({"enable_prefix_caching": False}, "--enable-prefix-caching"),
        ({"max_num_batched_tokens": 256}, "at least 384"),
        ({"max_num_batched_tokens": 1152, "chunk_size": 768}, "multiple or a divisor of 768"),
        ({"separate_object_groups": False}, "divisor of 384"),
    ],
)
def test_recurrent_config_errors_name_the_fix(kw: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        _recurrent(**kw)


def test_the_vllm_plugin_entry_point_is_installed() -> None:
    import importlib.metadata

    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.value == "tiercache.connector.plugin:register" for ep in plugins)
