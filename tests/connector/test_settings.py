"""The connector's settings (:mod:`tiercache.config.connector`): ``kv_connector_extra_config`` read
into :class:`ConnectorSettings`, its defaults, the errors that name the key, and the secret it never
prints. (The server's settings are tested in ``tests/test_settings.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tiercache.config.connector import ConnectorSettings
from tiercache.errors import ConfigError


def test_settings_defaults_and_prefixed_keys() -> None:
    s = ConnectorSettings.from_extra_config({})
    assert (s.server, s.timeout_s, s.retry_s, s.lookup_wait_s) == (None, 2.0, 5.0, 0.005)
    s = ConnectorSettings.from_extra_config(
        {"tiercache.server": "ipc:///x.sock", "timeout_s": "0.5", "other": 1}
    )
    assert (s.server, s.timeout_s) == ("ipc:///x.sock", 0.5)


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"server": "localhost:5600"}, "ipc://"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"tiercache.chunk_size": 256}, "unknown"),
        ({"overlap_loads": "sometimes"}, "overlap_loads"),
        ({"lookup_wait_s": -0.001}, "lookup_wait_s"),
        ({"lookup_wait_s": 3, "timeout_s": 2}, "lookup_wait_s=3.0 must be 0 to timeout_s"),
    ],
)
def test_settings_errors_name_the_key(extra: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        ConnectorSettings.from_extra_config(extra)


@pytest.mark.parametrize(
    ("value", "expected"), [(None, False), (True, True), ("false", False), ("On", True), (0, False)]
)
def test_overlap_loads_is_off_unless_set(value: object, expected: bool) -> None:
    extra = {} if value is None else {"overlap_loads": value}
    assert ConnectorSettings.from_extra_config(extra).overlap_loads is expected


@pytest.mark.parametrize("wait", [-1, 61, "soon"])
def test_inflight_wait_outside_its_range_is_refused(wait: object) -> None:
    with pytest.raises(ConfigError, match="inflight_wait_s"):
        ConnectorSettings.from_extra_config({"inflight_wait_s": wait})


def test_auth_secret_is_never_printed() -> None:
    s = ConnectorSettings.from_extra_config({"auth_secret": "hunter2"})
    assert s.auth_secret == "hunter2" and "hunter2" not in repr(s)


def test_the_secret_comes_from_a_file_and_an_inline_one_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM prints kv_connector_extra_config at start-up (its "non-default args" line) and it is on
    the engine's command line: a secret belongs in a file the config names."""
    secret = tmp_path / "secret"
    secret.write_text("s3cr3t-from-a-file\n")
    s = ConnectorSettings.from_extra_config({"auth_secret_file": str(secret)})
    assert s.auth_secret == "s3cr3t-from-a-file"
    assert not caplog.records
    ConnectorSettings.from_extra_config({"auth_secret": "hunter2"})
    assert any(
        "auth_secret_file" in r.getMessage() and "hunter2" not in r.getMessage() for r in caplog.records
    )
    with pytest.raises(ConfigError, match=r"auth_secret_file=.* cannot be read"):
        ConnectorSettings.from_extra_config({"auth_secret_file": str(tmp_path / "missing")})
