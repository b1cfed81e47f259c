"""ServerConfig: one frozen, validated object built from defaults < config file < environment < flags."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.conftest import S3Endpoint
from tiercache.config import (
    DiskConfig,
    EngineConfig,
    EvictionPolicyName,
    GiB,
    L1Config,
    L3Admission,
    L3WritePolicy,
    MiB,
    S3Config,
    ServerOptions,
)
from tiercache.config.parts import LogLevel
from tiercache.config.server import ServerConfig
from tiercache.config.table import options, options_by_key
from tiercache.errors import ArenaError, ConfigError, DiskTierError, S3TierError
from tiercache.keys.tenant import tenant_id, tenant_label
from tiercache.server.build import build_engine

SMALL_L1 = {"l1.size_gb": "0.01"}


def load(
    flags: dict[str, object] | None = None, env: dict[str, str] | None = None, file: Path | None = None
) -> ServerConfig:
    return ServerConfig.load(flags or {}, env or {}, file)


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tiercache.toml"
    path.write_text(text)
    return path


# -- defaults ---------------------------------------------------------------------------------------


def test_defaults_are_the_embedded_server_l1_and_disk_under_the_per_user_data_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    config = load()
    assert config.tiers == ("l1", "disk")
    assert config.disk is not None and config.disk.path == tmp_path / "tiercache" / "disk"
    assert config.s3 is None
    assert config.l1 == L1Config()
    assert config.engine == EngineConfig()
    assert config.log_level is LogLevel.INFO
    assert config.server.separate_object_groups is True


def test_without_xdg_data_home_the_disk_lives_under_local_share(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load()
    assert config.disk is not None
    assert config.disk.path == tmp_path / ".local" / "share" / "tiercache" / "disk"


def test_config_is_frozen() -> None:
    config = load()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.tiers = ("l1",)  # type: ignore[misc]


def test_it_composes_the_part_configs_rather_than_copying_their_fields() -> None:
    config = load({"tiers": "l1,disk,s3", "s3.bucket": "b"})
    assert isinstance(config.server, ServerOptions)
    assert isinstance(config.l1, L1Config)
    assert isinstance(config.disk, DiskConfig)
    assert isinstance(config.s3, S3Config)
    assert isinstance(config.engine, EngineConfig)


# -- the option table -------------------------------------------------------------------------------


def test_every_field_of_every_part_config_is_an_option() -> None:
    fields = {(o.section, o.field) for o in options()}
    for section, cls in (
        ("server", ServerOptions),
        ("l1", L1Config),
        ("disk", DiskConfig),
        ("s3", S3Config),
        ("engine", EngineConfig),
    ):
        for f in dataclasses.fields(cls):
            assert (section, f.name) in fields, f"{cls.__name__}.{f.name} has no option"


def test_every_option_has_help_and_unique_flag_env_and_key() -> None:
    opts = options()
    assert all(o.help for o in opts)
    for attr in ("flag", "env", "key"):
        values = [getattr(o, attr) for o in opts]
        assert len(values) == len(set(values)), f"duplicate {attr}"
    assert all(o.env == "TIERCACHE_" + o.flag[2:].upper().replace("-", "_") for o in opts)


def test_the_issue_s_flags_and_variables_exist() -> None:
    flags = {o.flag: o for o in options()}
    for flag in (
        "--tiers",
        "--chunk-size",
        "--separate-object-groups",
        "--l1-size-gb",
        "--l1-name",
        "--eviction-policy",
        "--disk-path",
        "--disk-size-gb",
        "--s3-bucket",
        "--s3-prefix",
        "--s3-endpoint-url",
        "--s3-region",
        "--s3-path-style",
        "--s3-capacity-gb",
        "--l3-write-policy",
        "--listen",
        "--auth-secret",
        "--curve-secret-key-file",
        "--metrics-port",
        "--log-level",
    ):
        assert flag in flags, flag
    assert flags["--auth-secret"].env == "TIERCACHE_AUTH_SECRET"
    assert flags["--auth-secret"].secret


# -- sources and precedence -------------------------------------------------------------------------


def test_flags_beat_environment_beat_file_beat_defaults(tmp_path: Path) -> None:
    file = write_toml(tmp_path, "[l1]\nsize_gb = 0.25\n[server]\nchunk_size = 512\nio_workers = 3\n")
    env = {"TIERCACHE_L1_SIZE_GB": "0.5", "TIERCACHE_CHUNK_SIZE": "1024"}
    config = load({"l1.size_gb": "0.75"}, env, file)
    assert config.l1.size_bytes == int(0.75 * GiB)  # flag
    assert config.server.chunk_size == 1024  # environment over file
    assert config.server.io_workers == 3  # file over default
    assert config.server.heartbeat_timeout_s == ServerOptions().heartbeat_timeout_s  # default


def test_sizes_take_decimals_in_gib() -> None:
    config = load({"l1.size_gb": "0.5", "disk.size_gb": "1.5", "server.max_message_mb": "8"})
    assert config.l1.size_bytes == 512 * MiB
    assert config.disk is not None and config.disk.budget_bytes == 1536 * MiB
    assert config.server.max_message_bytes == 8 * MiB


def test_booleans_from_flags_environment_and_file(tmp_path: Path) -> None:
    assert load({"server.separate_object_groups": False}).server.separate_object_groups is False
    assert load(env={"TIERCACHE_SEPARATE_OBJECT_GROUPS": "off"}).server.separate_object_groups is False
    file = write_toml(tmp_path, "[server]\nseparate_object_groups = false\n")
    assert load(file=file).server.separate_object_groups is False


def test_empty_environment_variables_count_as_unset() -> None:
    assert load(env={"TIERCACHE_CHUNK_SIZE": ""}).server.chunk_size == ServerOptions().chunk_size


def test_config_file_can_come_from_the_environment(tmp_path: Path) -> None:
    file = write_toml(tmp_path, 'tiers = ["l1", "disk", "s3"]\n[s3]\nbucket = "kv"\nprefix = "/prod/"\n')
    config = load(env={"TIERCACHE_CONFIG": str(file)})
    assert config.tiers == ("l1", "disk", "s3")
    assert config.s3 is not None and (config.s3.bucket, config.s3.prefix) == ("kv", "prod")


def test_enums_are_parsed_from_their_names() -> None:
    config = load(
        {
            "l1.eviction_policy": "s3fifo",
            "log_level": "DEBUG",
            "engine.l3_write_policy": "back",
            "tiers": "l1,disk,s3",
            "s3.bucket": "b",
        }
    )
    assert config.l1.eviction_policy is EvictionPolicyName.S3FIFO
    assert config.log_level is LogLevel.DEBUG
    assert config.engine.l3_write_policy is L3WritePolicy.BACK


# -- tiers --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tiers", ["l1", "l1,disk", "l1,s3", "l1,disk,s3"])
def test_allowed_tier_stacks(tiers: str) -> None:
    flags: dict[str, object] = {"tiers": tiers}
    if "s3" in tiers:
        flags["s3.bucket"] = "b"
    config = load(flags)
    assert config.tiers == tuple(tiers.split(","))
    assert (config.disk is not None) == ("disk" in tiers)
    assert (config.s3 is not None) == ("s3" in tiers)


@pytest.mark.parametrize(
    ("tiers", "says"),
    [
        (
            "disk,s3",
            "l1 (the shared-memory arena) is always required because workers copy KV through it: use l1,disk,s3",
        ),
        ("disk", "always required"),
        ("l1,s3,disk", "out of order; tiers go fastest first: use l1,disk,s3"),
        ("disk,l1", "must start with l1"),
        ("l1,l1", "names a tier twice"),
        ("l1,nvme", "unknown: nvme"),
        ("", "empty"),
    ],
)
def test_bad_tier_lists_say_what_to_use(tiers: str, says: str) -> None:
    with pytest.raises(ConfigError, match="--tiers") as info:
        load({"tiers": tiers})
    assert says in str(info.value)


def test_the_s3_tier_needs_a_bucket() -> None:
    with pytest.raises(
        ConfigError, match=r"includes s3 but no bucket is set; set --s3-bucket \(or TIERCACHE_S3_BUCKET"
    ):
        load({"tiers": "l1,disk,s3"})


def test_settings_of_a_tier_that_is_not_enabled_are_an_error_not_silently_ignored() -> None:
    with pytest.raises(
        ConfigError, match="TIERCACHE_S3_BUCKET is set but --tiers l1,disk has no s3 tier; add s3"
    ):
        load(env={"TIERCACHE_S3_BUCKET": "b"})
    with pytest.raises(ConfigError, match="--disk-path is set but --tiers l1,s3 has no disk tier"):
        load({"tiers": "l1,s3", "s3.bucket": "b", "disk.path": "/x"})


def test_write_back_needs_a_disk_tier_to_evict_from() -> None:
    with pytest.raises(ConfigError, match="use --tiers l1,disk,s3 or --l3-write-policy through"):
        load({"tiers": "l1,s3", "s3.bucket": "b", "engine.l3_write_policy": "back"})


def test_s3_admission_is_all_by_default_and_read_from_a_flag_the_environment_or_the_file(
    tmp_path: Path,
) -> None:
    three = {"tiers": "l1,disk,s3", "s3.bucket": "b"}
    assert load(three).engine.l3_admission is L3Admission.ALL
    assert load({**three, "engine.l3_admission": "read"}).engine.l3_admission is L3Admission.READ
    assert load(three, {"TIERCACHE_L3_ADMISSION": "read"}).engine.l3_admission is L3Admission.READ
    file = write_toml(tmp_path, '[engine]\nl3_admission = "read"\nl3_admission_window = 1000\n')
    config = load(three, file=file)
    assert (config.engine.l3_admission, config.engine.l3_admission_window) == (L3Admission.READ, 1000)
    assert "write-through, admission read" in config.describe()


def test_s3_admission_read_needs_a_disk_tier_and_a_window_of_at_least_one() -> None:
    with pytest.raises(ConfigError, match="use --tiers l1,disk,s3 or --l3-admission all"):
        load({"tiers": "l1,s3", "s3.bucket": "b", "engine.l3_admission": "read"})
    with pytest.raises(ConfigError, match="--l3-admission-window"):
        load({"tiers": "l1,disk,s3", "s3.bucket": "b", "engine.l3_admission_window": "0"})


# -- one-line errors naming the source, the value and the fix ---------------------------------------


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ({"l1.size_gb": "lots"}, {}, "--l1-size-gb lots is not a number; use a decimal number"),
        ({"l1.size_gb": "-1"}, {}, "--l1-size-gb -1 is not a positive size; give a number of GiB > 0"),
        ({}, {"TIERCACHE_DISK_SIZE_GB": "0"}, "TIERCACHE_DISK_SIZE_GB=0 is not a positive size"),
        (
            {"server.chunk_size": "1.5"},
            {},
            "--chunk-size 1.5 is not an integer; use a whole number, e.g. 256",
        ),
        ({"server.chunk_size": "0"}, {}, "--chunk-size must be a positive number of tokens, got 0"),
        (
            {"l1.eviction_policy": "fifo"},
            {},
            "--eviction-policy fifo is not a valid choice; use one of lru, s3fifo",
        ),
        (
            {},
            {"TIERCACHE_S3_PATH_STYLE": "maybe", "TIERCACHE_TIERS": "l1,s3", "TIERCACHE_S3_BUCKET": "b"},
            "TIERCACHE_S3_PATH_STYLE=maybe is not a boolean; use true or false",
        ),
        ({"server.metrics_port": "70000"}, {}, "--metrics-port 70000 is not a port number (0-65535)"),
        ({"l1.tenant_share": "1.5"}, {}, "--l1-tenant-share must be in (0, 1], got 1.5"),
        (
            {},
            {"TIERCACHE_DISK_TENANT_QUOTAS": "acme=0.5"},
            "TIERCACHE_DISK_TENANT_QUOTAS names a bad tenant: 'acme' is not a tenant id; use its 16 hex "
            "digits (`tiercache tenant-id SALT` prints them)",
        ),
        (
            {"l1.tenant_quotas": "default=0"},
            {},
            "--l1-tenant-quotas gives default the share '0'; give a fraction in (0, 1]",
        ),
        (
            {"server.listen": "http://x"},
            {},
            "--listen 'http://x' is not supported; use ipc:///path/to/socket",
        ),
    ],
)
def test_value_errors_name_the_source_the_value_and_the_fix(
    flags: dict[str, object], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load(flags, env)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_tenant_quotas_come_from_flags_and_variables_like_every_setting() -> None:
    acme = tenant_label(tenant_id("acme"))
    config = load({"l1.tenant_share": "0.25"}, {"TIERCACHE_DISK_TENANT_QUOTAS": f"{acme}=0.5,default=1"})
    assert config.l1.tenant_share == 0.25 and config.l1.tenant_overrides() == {}
    assert config.disk is not None
    assert config.disk.tenant_overrides() == {tenant_id("acme"): 0.5, b"": 1.0}


def test_errors_raised_by_a_part_config_are_renamed_to_the_variable_that_set_the_value() -> None:
    with pytest.raises(
        ConfigError, match=r"^TIERCACHE_DISK_LOW_WATERMARK 0.99 must be below the high watermark 0.95$"
    ):
        load(env={"TIERCACHE_DISK_LOW_WATERMARK": "0.99"})
    with pytest.raises(
        ConfigError, match=r"^TIERCACHE_LISTEN tcp://0.0.0.0:5555 is TCP, which needs authentication"
    ):
        load(env={"TIERCACHE_LISTEN": "tcp://0.0.0.0:5555"})


STRONG = "hunter2-7c4e1b8d6f0a9e23"


def test_tcp_is_accepted_with_a_shared_secret_from_the_environment() -> None:
    config = load({"server.listen": "tcp://127.0.0.1:5555"}, {"TIERCACHE_AUTH_SECRET": STRONG})
    assert config.server.auth_secret == STRONG


@pytest.mark.parametrize("weak", ["tiercache2024", "hunter2", "p@ssw0rd!", "ab" * 40, "0123456789abcdef"])
def test_a_shared_secret_under_128_bits_is_refused_saying_how_to_make_one(weak: str) -> None:
    # One recorded handshake (its nonce and HMAC) checks guesses offline: tiercache2024 fell after
    # 1,436 guesses. 32 hex digits (128 bits) is the least a secret may hold.
    with pytest.raises(ConfigError, match=r"128 bits.*openssl rand -hex 32") as info:
        load({"server.listen": "tcp://127.0.0.1:5555"}, {"TIERCACHE_AUTH_SECRET": weak})
    assert weak not in str(info.value)
    load({"server.listen": "tcp://127.0.0.1:5555"}, {"TIERCACHE_AUTH_SECRET": "0123456789abcdef" * 2})


def test_the_secret_can_come_from_a_file_kept_off_the_command_line(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text(STRONG + "\n")
    config = load({"server.listen": "tcp://127.0.0.1:5555", "server.auth_secret_file": str(path)})
    assert config.server.auth_secret == STRONG
    assert STRONG not in config.describe()
    path.write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        load({"server.listen": "tcp://127.0.0.1:5555", "server.auth_secret_file": str(path)})
    with pytest.raises(ConfigError, match="cannot be read"):
        load({"server.listen": "tcp://127.0.0.1:5555", "server.auth_secret_file": str(tmp_path / "none")})


def test_the_secret_is_never_shown() -> None:
    config = load({"server.listen": "tcp://127.0.0.1:5555", "server.auth_secret": STRONG})
    assert STRONG not in config.describe()
    assert "hunter2" not in repr(config)
    assert "shared secret" in config.describe()


# -- the config file ----------------------------------------------------------------------------------


def test_unknown_file_keys_are_errors_naming_the_nearest_valid_key(tmp_path: Path) -> None:
    file = write_toml(tmp_path, "[l1]\nsize_gib = 2\n")
    with pytest.raises(ConfigError, match=r"unknown key \[l1\] size_gib; did you mean \[l1\] size_gb\?"):
        load(file=file)


def test_flat_keys_are_pointed_at_their_table(tmp_path: Path) -> None:
    file = write_toml(tmp_path, "disk_size_gb = 2\n")
    with pytest.raises(ConfigError, match=r"unknown key disk_size_gb; did you mean \[disk\] size_gb\?"):
        load(file=file)


def test_wrongly_typed_file_values_name_the_key_and_the_file(tmp_path: Path) -> None:
    file = write_toml(tmp_path, '[server]\nchunk_size = "big"\n')
    with pytest.raises(ConfigError) as info:
        load(file=file)
    assert str(info.value).startswith(f"server.chunk_size = 'big' in {file} is not an integer")


def test_invalid_toml_and_missing_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load(file=write_toml(tmp_path, "[l1\n"))
    with pytest.raises(ConfigError, match="does not exist; fix --config / TIERCACHE_CONFIG"):
        load(file=tmp_path / "missing.toml")


def test_every_option_can_be_set_from_the_file(tmp_path: Path) -> None:
    # TOML keys are exactly the option keys: a table per part, top-level keys bare.
    assert set(options_by_key()) >= {
        "tiers",
        "log_level",
        "server.listen",
        "l1.size_gb",
        "disk.path",
        "s3.bucket",
        "engine.l3_write_policy",
    }


# -- describe() and build_engine() --------------------------------------------------------------------


def test_describe_says_tiers_listen_address_storage_and_budgets(tmp_path: Path) -> None:
    config = load(
        {
            "tiers": "l1,disk,s3",
            "l1.size_gb": "2",
            "disk.path": str(tmp_path / "d"),
            "disk.size_gb": "100",
            "s3.bucket": "kv",
            "s3.prefix": "prod",
            "s3.endpoint_url": "http://127.0.0.1:9000",
            "server.listen": "ipc:///tmp/x.sock",
            "server.metrics_port": "9400",
        }
    )
    text = config.describe()
    for expected in (
        "l1 -> disk -> s3",
        "ipc:///tmp/x.sock",
        "2 GiB",
        f"100 GiB in {tmp_path / 'd'}",
        "s3://kv/prod",
        "endpoint http://127.0.0.1:9000",
        "http://127.0.0.1:9400/metrics",
    ):
        assert expected in text


def test_build_engine_composes_l1_and_disk(tmp_path: Path) -> None:
    config = load({**SMALL_L1, "disk.path": str(tmp_path / "disk"), "disk.size_gb": "0.01"})
    engine = build_engine(config)
    try:
        assert [t.name for t in engine.tiers] == ["l1", "disk"]
        assert (tmp_path / "disk" / "data.mdb").exists()
    finally:
        engine.close()


def test_build_engine_composes_all_three_tiers(tmp_path: Path, s3: S3Endpoint) -> None:
    config = load(
        {
            **SMALL_L1,
            "tiers": "l1,disk,s3",
            "disk.path": str(tmp_path / "disk"),
            "s3.bucket": "kv-cache",
            "s3.endpoint_url": s3.url,
            "s3.region": s3.region,
            "s3.path_style": True,
            "s3.create_bucket": True,
        }
    )
    engine = build_engine(config)
    try:
        assert [t.name for t in engine.tiers] == ["l1", "disk", "s3"]
    finally:
        engine.close()


def test_an_unwritable_disk_directory_fails_at_start_up(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a directory cannot be created under a regular file, even by root
    config = load({**SMALL_L1, "disk.path": str(blocker / "disk")})
    with pytest.raises(
        DiskTierError, match=r"is not writable .*; fix its permissions or choose another --disk-path"
    ):
        build_engine(config)


def test_an_unreachable_bucket_fails_at_start_up_with_the_s3_tier_s_message(s3: S3Endpoint) -> None:
    config = load(
        {
            **SMALL_L1,
            "tiers": "l1,s3",
            "s3.bucket": "no-such-bucket",
            "s3.endpoint_url": s3.url,
            "s3.region": s3.region,
            "s3.path_style": True,
            "s3.max_attempts": "1",
        }
    )
    with pytest.raises(S3TierError, match="does not exist; create it, fix --s3-bucket"):
        build_engine(config)


def test_a_too_small_dev_shm_fails_at_start_up() -> None:
    config = load({"l1.size_gb": "1000000", "tiers": "l1"})
    with pytest.raises(ArenaError, match="lower --l1-size-gb or enlarge /dev/shm"):
        build_engine(config)
