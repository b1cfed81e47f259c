"""Fixtures for the reliability scenarios: real server processes (from tests/server)."""

from tests.server.conftest import start_server  # noqa: F401  (re-exported fixture)
