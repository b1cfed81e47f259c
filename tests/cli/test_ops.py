"""`tiercache clear` and `tiercache warm` against a real server process: what they do, and what they print.

Specification: both work in batches; on a terminal a progress bar goes to stderr; with `--json` or
without a terminal only the result is printed (JSON on stdout, or one summary line), never escape codes.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import make_key
from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.cli.app import main
from tiercache.cli.output import Progress
from tiercache.client.client import Client
from tiercache.keys import ObjectKey
from tiercache.testing.poll import wait_until

KiB = 1 << 10
OBJECTS = 12
SIZE = 64 * KiB


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server (L1 4 MiB + disk) holding OBJECTS objects of SIZE in both tiers."""
    proc = ServerProcess(
        ServerSpec(
            listen=f"ipc://{tmp_path}/sock/server.sock", l1_bytes=4 << 20, disk_path=str(tmp_path / "disk")
        )
    )
    try:
        proc.wait_ready()
        with proc.client() as client:
            keys = [make_key(i) for i in range(OBJECTS)]
            assert client.store_chunks(keys, [os.urandom(SIZE) for _ in keys]) == OBJECTS
            wait_until(
                lambda: client.stats()["tiers"]["disk"]["objects"] == OBJECTS,
                what="the write-through to disk",
            )
        yield proc
    finally:
        proc.stop()


def objects(client: Client) -> dict[str, int]:
    return {name: t["objects"] for name, t in client.stats()["tiers"].items()}


def test_clear_one_tier_in_batches_leaves_the_others(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["clear", "--server", server.endpoint, "--tier", "disk", "--batch", "5", "--yes", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["cleared"] == {"disk": OBJECTS}
    assert err == ""  # no progress without a terminal
    with server.client() as client:
        assert objects(client) == {"l1": OBJECTS, "disk": 0}


def test_clear_of_every_tier_prints_one_summary_line(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["clear", "--server", server.endpoint, "--yes"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith(f"cleared {2 * OBJECTS} objects (l1 {OBJECTS}, disk {OBJECTS}) in ")
    assert len(out.splitlines()) == 1 and "\x1b" not in out + err
    with server.client() as client:
        assert objects(client) == {"l1": 0, "disk": 0}


def test_clear_without_yes_deletes_nothing_and_says_how_to_confirm(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["clear", "--server", server.endpoint, "--tier", "l1"]) == 2
    err = capsys.readouterr().err
    assert f"({OBJECTS} held now); add --yes to confirm" in err and len(err.splitlines()) == 1
    with server.client() as client:
        assert objects(client)["l1"] == OBJECTS


def test_clear_of_an_unknown_tier_names_the_servers_tiers(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["clear", "--server", server.endpoint, "--tier", "s3", "--yes"]) == 2
    assert "--tier 's3': this server has l1, disk" in capsys.readouterr().err


def test_on_a_terminal_clear_shows_a_progress_bar_on_stderr(
    server: ServerProcess, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tty = _Tty()
    monkeypatch.setattr("sys.stderr", tty)
    assert main(["clear", "--server", server.endpoint, "--tier", "disk", "--batch", "4", "--yes"]) == 0
    bar = tty.getvalue()
    assert "clear disk" in bar and "100%" in bar and f"{OBJECTS} objects" in bar
    assert "\x1b" not in capsys.readouterr().out  # the bar never reaches stdout


def test_warm_promotes_from_disk_into_l1_up_to_the_budget_most_recently_used_first(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    with server.client() as client:
        while client.clear_batch(100, tier="l1"):
            pass
        assert client.get(make_key(0)) is not None  # read from disk (and promoted): now its youngest
        while client.clear_batch(100, tier="l1"):
            pass
        # The disk tier applies read touches in the background, once per sync interval.
        wait_until(
            lambda: client.list_keys(tier="disk", limit=1, order="use")[0][0].key == make_key(0).to_bytes(),
            what="the read's recency touch",
        )
        by_use = [ObjectKey.from_bytes(k.key) for k in client.list_keys(tier="disk", order="use")[0]]
    assert (
        main(["warm", "--server", server.endpoint, "--budget", f"{4 * SIZE}", "--batch", "3", "--json"]) == 0
    )
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert err == ""
    assert result["tier"] == "disk" and result["budget_bytes"] == 4 * SIZE
    assert (result["promoted"], result["bytes"]) == (4, 4 * SIZE)
    with server.client() as client:
        assert objects(client)["l1"] == 4
        # The promoted objects are the one just read, then the newest writes.
        in_l1 = [data is not None for data in client.load_chunks(by_use[:6])]
        assert in_l1 == [True, True, True, True, False, False]

    # Without --budget: L1's free space, which holds the rest; the four already there are skipped.
    assert main(["warm", "--server", server.endpoint]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        f"warmed {OBJECTS - 4} objects ({(OBJECTS - 4) * SIZE // KiB}.0 KiB) from disk into l1; 4 already there"
    )
    with server.client() as client:
        assert objects(client)["l1"] == OBJECTS


def test_warm_refuses_l1_as_its_source(server: ServerProcess, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["warm", "--server", server.endpoint, "--tier", "l1"]) == 2
    assert "use one of disk" in capsys.readouterr().err


def test_the_progress_display_is_silent_unless_enabled() -> None:
    quiet = io.StringIO()
    with Progress.for_terminal(as_json=False, stream=quiet) as progress:  # not a terminal
        progress.advance(progress.step("warm", 10), 10, "10 objects")
    assert quiet.getvalue() == ""
    json_on_tty = _Tty()
    with Progress.for_terminal(as_json=True, stream=json_on_tty) as progress:
        progress.advance(progress.step("warm", 10), 10, "10 objects")
    assert json_on_tty.getvalue() == ""
