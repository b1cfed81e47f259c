"""What importing a module loads: the data plane a vLLM worker needs stays free of the server side,
and the package face stays free of torch and vLLM. Checked in a fresh interpreter each time (the
import contracts in pyproject.toml check the source; this checks what Python actually loads)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVER_SIDE = (
    "tiercache.server",
    "tiercache.engine",
    "tiercache.tier",
    "tiercache.l2_disk",
    "tiercache.l3_s3",
    "lmdb",
    "boto3",
    "botocore",
)


def loaded_after(statement: str) -> set[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(json.loads(proc.stdout.splitlines()[-1]))


def server_side(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == s or m.startswith(s + ".") for s in SERVER_SIDE))


@pytest.mark.parametrize(
    "module", ["tiercache.client.client", "tiercache.connector", "tiercache.l1.arena", "tiercache.l1.copy"]
)
def test_the_worker_side_loads_nothing_of_the_server_side(module: str) -> None:
    assert server_side(loaded_after(f"import {module}")) == []


def test_the_connector_itself_loads_nothing_of_the_server_side() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("the connector class needs vLLM (CI runs this in its vLLM environment)")
    assert server_side(loaded_after("import tiercache.connector.connector")) == []


def test_the_package_face_the_config_and_the_connector_package_stay_light() -> None:
    """vLLM and torch load only when vLLM builds the connector (its class is imported lazily)."""
    loaded = loaded_after(
        "import tiercache, tiercache.config, tiercache.errors, tiercache.keys, tiercache.connector, "
        "tiercache.keys.weights"
    )
    assert sorted(m for m in loaded if m.split(".")[0] in ("torch", "vllm", "zmq")) == []
    assert server_side(loaded) == []
