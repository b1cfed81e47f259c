"""`tiercache server` through the real entry point: one-line errors, exit codes, and --help.

Exit codes: 2 for a bad flag, variable or config file; 1 for a start-up failure (the tiers' checks).
Most tests call ``main([...])`` in-process for speed; one runs the installed console script.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.conftest import one_line
from tests.conftest import S3Endpoint
from tiercache.cli.app import main
from tiercache.config.table import options

SMALL = ["--l1-size-gb", "0.01", "--disk-size-gb", "0.01"]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- configuration errors: one line, exit 2 --------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--l1-size-gb", "big"], "--l1-size-gb big is not a number"),
        (["--chunk-size", "-4"], "--chunk-size must be a positive number of tokens, got -4"),
        (["--tiers", "disk,s3"], "l1 (the shared-memory arena) is always required"),
        (["--eviction-policy", "mru"], "use one of lru, s3fifo"),
        (
            ["--listen", "tcp://0.0.0.0:7000"],
            "needs authentication: set --auth-secret-file (or TIERCACHE_AUTH_SECRET)",
        ),
        (["--tiers", "l1,disk,s3"], "no bucket is set; set --s3-bucket"),
    ],
)
def test_a_bad_flag_value_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    code, out, err = run_cli(capsys, "server", *argv)
    assert code == 2
    line = one_line(err)
    assert line.startswith("tiercache: error: ")
    assert says in line
    assert out == ""


def test_a_bad_environment_variable_is_named(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERCACHE_DISK_SIZE_GB", "ten")
    code, _, err = run_cli(capsys, "server")
    assert code == 2
    assert one_line(err) == (
        "tiercache: error: TIERCACHE_DISK_SIZE_GB=ten is not a number; use a decimal number, e.g. 10"
    )


def test_an_unknown_flag_suggests_the_nearest(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "server", "--l1-size-gib", "2")
    assert code == 2
    assert "did you mean --l1-size-gb?" in one_line(err)


def test_flags_cannot_be_abbreviated(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "server", "--l1-size", "2")
    assert code == 2
    assert "unrecognized arguments: --l1-size" in one_line(err)


def test_a_config_file_with_an_unknown_key_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "tc.toml"
    config.write_text('[disk]\npath = "/tmp/x"\nsize_gb = 1\nwatermark = 0.9\n')
    code, _, err = run_cli(capsys, "server", "--config", str(config))
    assert code == 2
    line = one_line(err)
    assert line.startswith(
        f"tiercache: error: config file {config}: unknown key [disk] watermark; did you mean"
    )


def test_a_missing_config_file_is_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run_cli(capsys, "server", "--config", str(tmp_path / "nope.toml"))
    assert code == 2
    assert "does not exist" in one_line(err)


# -- start-up failures: one line, exit 1 ------------------------------------------------------------


def test_an_unwritable_disk_directory_is_one_line_and_exit_1(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run_cli(capsys, "server", *SMALL, "--disk-path", str(blocker / "disk"))
    assert code == 1
    line = one_line(err)
    assert line.startswith("tiercache: DiskTierError: the disk tier directory")
    assert "choose another --disk-path" in line


def test_an_unreachable_bucket_is_one_line_and_exit_1(
    capsys: pytest.CaptureFixture[str], s3: S3Endpoint
) -> None:
    code, _, err = run_cli(
        capsys,
        "server",
        *SMALL,
        "--tiers",
        "l1,disk,s3",
        "--s3-bucket",
        "missing-bucket",
        "--s3-endpoint-url",
        s3.url,
        "--s3-region",
        s3.region,
        "--s3-path-style",
        "--s3-max-attempts",
        "1",
    )
    assert code == 1
    line = one_line(err)
    assert line.startswith("tiercache: S3TierError: S3 bucket 'missing-bucket'")
    assert "does not exist" in line


def test_a_too_small_dev_shm_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "server", "--l1-size-gb", "1000000")
    assert code == 1
    assert one_line(err).startswith("tiercache: ArenaError: /dev/shm has")


# -- help ---------------------------------------------------------------------------------------------


def test_help_explains_every_flag_with_its_default_and_variable(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "server", "--help")
    assert code == 0
    text = " ".join(out.split())  # argparse wraps lines
    for opt in options():
        assert opt.flag in text
        assert f"env {opt.env}" in text
    assert "--no-separate-object-groups" in text
    assert "(default: 1; env TIERCACHE_L1_SIZE_GB)" in text
    assert "(default: lru; env TIERCACHE_EVICTION_POLICY)" in text
    assert "~/.local/share/tiercache/disk" in text
    assert "--config FILE" in text and "TIERCACHE_CONFIG" in text


def test_bench_still_works(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys, "bench", "--tiers", "l1", "--sizes", "256k", "--total-mb", "1", "--rounds", "1"
    )
    assert code == 0
    assert "L1" in out or "l1" in out


def test_the_console_script_reports_a_bad_value_in_one_line_with_exit_2(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("tiercache")
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "tiercache.cli"]
    proc = subprocess.run(
        [*argv, "server", "--disk-size-gb", "0.5GB"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert proc.returncode == 2
    assert one_line(proc.stderr) == (
        "tiercache: error: --disk-size-gb 0.5GB is not a number; use a decimal number, e.g. 10"
    )
