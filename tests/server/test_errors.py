"""Specification: bad client input gets an error reply naming the problem; everyone else is served."""

from __future__ import annotations

import os
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import StartServer, manifest
from tests.server.rawsock import RawSocket
from tests.server.serverproc import ServerProcess
from tiercache.errors import ProtocolError, ServerError
from tiercache.keys import Fingerprint, ObjectKey
from tiercache.testing.poll import wait_until
from tiercache.wire import protocol as p

MiB = 1 << 20


def key(i: int) -> ObjectKey:
    return ObjectKey(Fingerprint(b"F" * 16), 0, i.to_bytes(16, "big"))


@pytest.fixture
def server(start_server: StartServer) -> ServerProcess:
    return start_server(options={"max_message_bytes": 1 * MiB})


@pytest.fixture
def raw(server: ServerProcess) -> RawSocket:
    sock = RawSocket(server.endpoint)
    yield sock  # type: ignore[misc]
    sock.close()


def error_of(reply: object) -> p.ErrorCode:
    assert isinstance(reply, p.ErrorReply), reply
    assert reply.message
    return reply.code


def test_a_different_protocol_version_is_refused(raw: RawSocket) -> None:
    reply = raw.request(p.Hello(req_id=5, protocol_version=p.PROTOCOL_VERSION + 1))
    assert error_of(reply) is p.ErrorCode.VERSION_MISMATCH
    assert reply.req_id == 5  # type: ignore[union-attr]


def test_requests_before_hello_are_refused(raw: RawSocket) -> None:
    assert error_of(raw.request(p.Stats())) is p.ErrorCode.HELLO_REQUIRED


def test_malformed_oversized_and_unknown_messages_get_error_replies(
    server: ServerProcess, raw: RawSocket
) -> None:
    raw.hello()
    assert error_of(raw.request(b"\xc1 not msgpack")) is p.ErrorCode.MALFORMED
    assert error_of(raw.request(msgspec.msgpack.encode([1, 2, 3]))) is p.ErrorCode.MALFORMED
    assert (
        error_of(raw.request(msgspec.msgpack.encode({"op": "reserve", "items": "x"})))
        is p.ErrorCode.MALFORMED
    )
    assert (
        error_of(raw.request(msgspec.msgpack.encode({"op": "teleport", "req_id": 9})))
        is p.ErrorCode.UNKNOWN_OP
    )
    big = p.Put(key=key(1).to_bytes(), data=b"\0" * (MiB + 10))
    assert error_of(raw.request(big)) is p.ErrorCode.TOO_LARGE
    raw.send_frames([b"a", b"b"])
    assert error_of(raw.receive()) is p.ErrorCode.MALFORMED
    assert error_of(raw.request(p.Reserve(items=[(b"short", 10)]))) is p.ErrorCode.INVALID
    with server.client() as good:
        good.ping()


def test_out_of_order_messages_are_refused_and_the_loop_goes_on(server: ServerProcess) -> None:
    with server.client() as alice, server.client() as bob:
        with pytest.raises(ServerError) as err:
            alice.commit([123456])
        assert err.value.code == "unknown_token"

        assert alice.put(key(1), b"x" * 4096)
        [lease] = alice.pin([key(1)])
        assert lease is not None
        with pytest.raises(ServerError) as err:
            bob.release([lease.token])
        assert err.value.code == "not_owner"
        [slot] = bob.reserve([(key(2), 4096)])
        with pytest.raises(ServerError) as err:
            alice.commit([slot.token])
        assert err.value.code == "not_owner"
        assert bob.commit([slot.token]) == 1
        with pytest.raises(ServerError) as err:
            bob.commit([slot.token])  # twice
        assert err.value.code == "unknown_token"
        assert alice.release([lease.token]) == 1
        with pytest.raises(ServerError):
            alice.lookup([b"h" * 16], [p.GroupRef(b"Z" * 16, 0)])  # never registered


def test_version_mismatch_surfaces_as_a_protocol_error(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(p, "PROTOCOL_VERSION", p.PROTOCOL_VERSION + 1)
    with pytest.raises(ProtocolError, match="protocol"):
        server.client()


def test_a_silent_clients_reservations_and_leases_are_released(start_server: StartServer) -> None:
    server = start_server(options={"heartbeat_timeout_s": 0.5})
    with server.client() as watcher:
        silent = server.client(heartbeat=False)
        assert silent.put(key(1), b"y" * 4096)
        silent.reserve([(key(2), 1 * MiB)])
        silent.pin([key(1)])
        assert watcher.stats()["server"]["reservations"] == 1

        # Poll (never a fixed sleep) until the server has expired the silent client. The
        # counter alone is not enough: the fixture's readiness probe is a client that went
        # silent too, and it may be the one expired first on a slow machine.
        def released() -> dict[str, Any] | None:
            stats = watcher.stats()
            server = stats["server"]
            return stats if server["reservations"] == 0 and server["leases"] == 0 else None

        stats = wait_until(released, what="the silent client's reservations and leases to go")
        assert stats["server"]["clients_expired"] >= 1
        assert stats["tiers"]["l1"]["bytes_used"] == 4096  # only the committed object remains
        # The heartbeating client was kept all along.
        watcher.ping()
        # The silent one comes back: it says hello again transparently.
        silent.ping()
        silent.close()


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
    request_structs.map(lambda m: p.Codec().encode(m)),
    st.dictionaries(
        st.sampled_from(["op", "req_id", "tokens", "key", "items"]),
        st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=8), st.binary(max_size=8), st.none()),
        max_size=4,
    ).map(msgspec.msgpack.encode),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frame=frames)
def test_fuzzed_requests_get_a_reply_or_are_dropped_and_the_server_stays_up(
    raw: RawSocket, frame: bytes
) -> None:
    raw.hello()
    reply = raw.request(frame, timeout_s=10.0)
    assert reply is None or isinstance(reply, p.Reply.__args__)  # type: ignore[attr-defined]
    assert isinstance(raw.request(p.Ping(req_id=77)), p.Pong)


def test_the_fuzzed_server_still_serves_a_normal_client(server: ServerProcess, raw: RawSocket) -> None:
    raw.hello()
    for _ in range(50):
        raw.request(os.urandom(64), timeout_s=10.0)
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        assert group.object_group == 0
