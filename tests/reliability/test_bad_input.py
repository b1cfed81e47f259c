"""Scenario: Hypothesis-fuzzed protocol frames over a real socket *while* a well-behaved client works.

Every frame is followed by a ping on the same session: whatever the frame was (any request type
with fuzzed fields, raw bytes, msgpack maps of request-like keys), every reply the server sends is a
well-formed reply, the ping is answered with a pong (the server is up and the session still served,
without a new hello) and the client storing and reading checked chunks in a thread sees no error
and no wrong byte. tests/server/test_errors.py has the named cases (malformed, oversized, unknown,
out-of-order and out-of-version messages); bad CLI flags and config files are
tests/cli/test_server_cli.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.common import figures, payload
from tests.server.conftest import manifest
from tests.server.rawsock import RawSocket
from tests.server.serverproc import ServerProcess
from tiercache.keys import ObjectKey
from tiercache.wire import protocol as p
from tiercache.wire.codec import Codec

KiB = 1 << 10
FUZZED = {"frames": 0, "replies": 0}

request_structs = st.one_of(
    st.builds(p.Ping, req_id=st.integers(0, 2**32)),
    st.builds(p.Commit, tokens=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4)),
    st.builds(p.Abort, tokens=st.lists(st.integers(0, 2**40), max_size=4)),
    st.builds(p.Release, tokens=st.lists(st.integers(0, 2**40), max_size=4)),
    st.builds(p.PollTicket, ticket=st.integers(0, 2**40)),
    st.builds(p.ReleaseTicket, ticket=st.integers(0, 2**40)),
    st.builds(
        p.Reserve, items=st.lists(st.tuples(st.binary(max_size=40), st.integers(-5, 2**40)), max_size=3)
    ),
    st.builds(p.Pin, keys=st.lists(st.binary(max_size=40), max_size=3)),
    st.builds(p.Get, key=st.binary(max_size=40)),
    st.builds(p.Put, key=st.binary(max_size=40), data=st.binary(max_size=64)),
    st.builds(
        p.Lookup,
        hashes=st.lists(st.binary(max_size=20), max_size=3),
        groups=st.lists(st.builds(p.GroupRef, st.binary(max_size=20), st.integers(-3, 70000)), max_size=2),
    ),
    st.builds(
        p.Explain,
        hashes=st.lists(st.binary(max_size=20), max_size=3),
        groups=st.lists(st.builds(p.GroupRef, st.binary(max_size=20), st.integers(0, 3)), max_size=2),
    ),
    st.builds(
        p.ListKeys,
        tier=st.sampled_from(["", "l1", "nope"]),
        cursor=st.binary(max_size=40),
        limit=st.integers(-10, 10**6),
    ),
    st.builds(p.GetManifest, fingerprint=st.binary(max_size=20)),
    st.builds(p.Clear, fingerprint=st.binary(max_size=20)),
    st.builds(
        p.RegisterEngine,
        groups=st.lists(
            st.builds(
                p.RegisterGroup,
                st.integers(-1, 3),
                st.dictionaries(st.text(max_size=8), st.integers(-(2**63), 2**63 - 1), max_size=3),
            ),
            max_size=2,
        ),
    ),
    st.builds(
        p.Hello,
        protocol_version=st.integers(0, 3),
        client_name=st.text(max_size=20),
        auth=st.binary(max_size=8),
    ),
)

frames = st.one_of(
    st.binary(max_size=256),
    request_structs.map(lambda m: Codec().encode(m)),
    st.dictionaries(
        st.sampled_from(["op", "req_id", "tokens", "key", "items"]),
        st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=8), st.binary(max_size=8), st.none()),
        max_size=4,
    ).map(msgspec.msgpack.encode),
)


@dataclass
class Shared:
    """The fuzzed server, the raw socket that fuzzes it, and the good client working meanwhile."""

    server: ServerProcess
    raw: RawSocket
    counts: dict[str, int]
    stop: threading.Event
    thread: threading.Thread

    def finish_good_client(self) -> None:
        """Stop the good client and wait for it, so its last operation is counted too."""
        self.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the good client is stuck"


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    from tests.server.serverproc import ServerSpec

    tmp = tmp_path_factory.mktemp("fuzz")
    server = ServerProcess(ServerSpec(listen=f"ipc://{tmp}/server.sock", options={"chunk_size": 256}))
    server.wait_ready()
    raw = RawSocket(server.endpoint)
    raw.hello()
    counts = {"ops": 0, "hits": 0, "wrong": 0, "errors": 0}
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
                        counts["hits"] += v is not None
                        counts["wrong"] += v is not None and v != payload(k, 4 * KiB)
                except Exception:
                    counts["errors"] += 1
                counts["ops"] += 2
                i += 1

    thread = threading.Thread(target=good_client, name="good-client")
    thread.start()
    yield Shared(server, raw, counts, stop, thread)
    stop.set()
    thread.join(30)
    raw.close()
    server.stop()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frame=frames)
def test_fuzzed_frames_get_a_reply_or_are_dropped_and_the_session_is_still_served(
    shared: Shared, frame: bytes
) -> None:
    raw = shared.raw
    # Greeted before every frame (a fuzzed hello may change who we are); a late reply to the frame
    # before (answered from the server's I/O executor) may come first.
    late = raw.hello()
    replies, answer = raw.probe(frame)
    FUZZED["frames"] += 1
    FUZZED["replies"] += len(replies)
    for reply in [*late, *replies]:  # decoded as replies already: anything else would have raised
        assert isinstance(reply, p.Reply.__args__)  # type: ignore[attr-defined]
    assert isinstance(answer, p.Pong), answer


def test_the_good_client_saw_no_error_and_no_wrong_byte(shared: Shared) -> None:
    shared.finish_good_client()
    counts = shared.counts
    figures(
        "fuzz-concurrent",
        fuzzed_frames=FUZZED["frames"],
        error_replies=FUZZED["replies"],
        good_client_ops=counts["ops"],
        good_client_errors=counts["errors"],
        good_client_hits=counts["hits"],
        wrong_reads=counts["wrong"],
    )
    assert FUZZED["frames"] > 0
    assert counts["ops"] > 0
    # A server that lost every chunk would read no wrong byte: what it stored must come back.
    assert counts["hits"] > 0
    assert counts["errors"] == 0 and counts["wrong"] == 0
