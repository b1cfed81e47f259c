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
