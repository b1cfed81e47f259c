"""Scenario: Hypothesis-fuzzed protocol frames over a real socket *while* a well-behaved client works.

tests/server/test_errors.py already fuzzes a server (malformed, oversized, unknown, out-of-order and
out-of-version messages) and checks it still answers afterwards; bad CLI flags and config files are
tests/cli/test_server_cli.py. This adds the "at the same time": a client storing and reading checked
chunks in a thread must see no error and no wrong byte while the fuzzer runs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings

from tests.reliability.common import figures, payload
from tests.server.conftest import manifest
from tests.server.rawsock import RawSocket
from tests.server.serverproc import ServerProcess
from tests.server.test_errors import frames
from tiercache.keys import ObjectKey
from tiercache.wire import protocol as p

KiB = 1 << 10
FUZZED = {"frames": 0, "replies": 0}


@pytest.fixture(scope="module")
def shared(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerProcess, RawSocket, dict[str, int], threading.Event]]:
    from tests.server.serverproc import ServerSpec

    tmp = tmp_path_factory.mktemp("fuzz")
    server = ServerProcess(ServerSpec(listen=f"ipc://{tmp}/server.sock", options={"chunk_size": 256}))
    server.wait_ready()
    raw = RawSocket(server.endpoint)
    raw.hello()
    counts = {"ops": 0, "wrong": 0, "errors": 0}
    stop = threading.Event()

    def good_client() -> None:
        with server.client() as c:
            [_group] = c.register([(0, manifest())])
            fp = manifest().fingerprint()
            i = 0
            while not stop.is_set():
                keys = [ObjectKey(fp, 0, (i * 4 + j).to_bytes(16, "big")) for j in range(4)]
                try:
                    c.store_chunks(keys, [payload(k, 4 * KiB) for k in keys])
                    for k, v in zip(keys, c.load_chunks(keys)):
                        counts["wrong"] += v is not None and v != payload(k, 4 * KiB)
                except Exception:
                    counts["errors"] += 1
                counts["ops"] += 2
                i += 1

    thread = threading.Thread(target=good_client, name="good-client")
    thread.start()
    yield server, raw, counts, stop
    stop.set()
    thread.join(30)
    raw.close()
    server.stop()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frame=frames)
def test_fuzzed_frames_get_answers_while_a_good_client_is_served(shared, frame: bytes) -> None:  # type: ignore[no-untyped-def]
    _, raw, _, _ = shared
    reply = raw.request(frame, timeout_s=10.0)
    FUZZED["frames"] += 1
    FUZZED["replies"] += reply is not None
    raw.hello()  # a fuzzed hello may have changed who we are; stay a greeted client
    assert isinstance(raw.request(p.Ping(req_id=77)), p.Pong)


def test_the_good_client_saw_no_error_and_no_wrong_byte(shared) -> None:  # type: ignore[no-untyped-def]
    _server, _, counts, stop = shared
    stop.set()
    figures(
        "fuzz-concurrent",
        fuzzed_frames=FUZZED["frames"],
        error_replies=FUZZED["replies"],
        good_client_ops=counts["ops"],
        good_client_errors=counts["errors"],
        wrong_reads=counts["wrong"],
    )
    assert FUZZED["frames"] > 0
    assert counts["ops"] > 0
    assert counts["errors"] == 0 and counts["wrong"] == 0
