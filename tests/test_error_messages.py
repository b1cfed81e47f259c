"""User-facing errors say what happened and what to do, naming the flag (or variable) to change."""

from __future__ import annotations

import pytest

from tiercache.config.server import ServerConfig
from tiercache.errors import ConfigError


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ({"engine.write_queue_depth": "0"}, "--write-queue-depth must be >= 1, got 0; use e.g. 256"),
        ({"engine.promote_workers": "0"}, "--promote-workers must be >= 1, got 0; use e.g. 4"),
        ({"engine.write_workers": "0"}, "--write-workers must be >= 1, got 0; use e.g. 2"),
    ],
)
def test_engine_settings_name_the_flag_and_the_fix(flags: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError) as err:
        ServerConfig.load(flags, {})
    assert says in str(err.value)


def test_an_engine_setting_from_the_environment_names_the_variable() -> None:
    with pytest.raises(ConfigError) as err:
        ServerConfig.load({}, {"TIERCACHE_WRITE_WORKERS": "0"})
    assert "TIERCACHE_WRITE_WORKERS" in str(err.value) and "use e.g. 2" in str(err.value)
