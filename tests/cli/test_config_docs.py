"""docs/configuration.md is generated from the option table and must match it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from tiercache.cli.app import main
from tiercache.config.docs import render_docs
from tiercache.config.server import ServerConfig
from tiercache.config.table import options

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
REGENERATE = "tiercache config docs --output docs/configuration.md"


def test_the_committed_reference_matches_the_option_table() -> None:
    assert DOC.read_text() == render_docs(), (
        f"docs/configuration.md is stale; regenerate it with: {REGENERATE}"
    )


def test_the_reference_lists_every_flag_variable_and_file_key() -> None:
    text = DOC.read_text()
    for opt in options():
        assert f"`{opt.flag}" in text and f"`{opt.env}`" in text and f"`{opt.toml_name}`" in text


def test_config_docs_prints_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "docs"]) == 0
    assert capsys.readouterr().out == render_docs()


def test_the_example_config_file_in_the_reference_is_valid(tmp_path: Path) -> None:
    example = re.search(r"```toml\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert example is not None
    path = tmp_path / "example.toml"
    path.write_text(example.group(1))
    tomllib.loads(example.group(1))
    config = ServerConfig.load({}, {"TIERCACHE_AUTH_SECRET": "s-0f9a27c4e1b8d6a35c2e"}, path)
    assert config.tiers == ("l1", "disk", "s3")
    assert config.s3 is not None and config.s3.bucket == "my-kv-cache"
