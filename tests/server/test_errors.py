"""Specification: bad client input gets an error reply naming the problem; everyone else is served.

Hypothesis-fuzzed frames (every request type with fuzzed fields, raw bytes, msgpack maps) are
tests/reliability/test_bad_input.py: one fuzzing run against a live server, with a good client
working meanwhile.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from tests.server.conftest import StartServer, manifest
from tests.server.rawsock import RawSocket
from tests.server.serverproc import ServerProcess
from tiercache.errors import ProtocolError, ServerError
from tiercache.keys import Fingerprint, ObjectKey
from tiercache.keys.digest import digest
from tiercache.testing.poll import stop_process, wait_until
from tiercache.wire import protocol as p
from tiercache.wire.codec import Codec
from tiercache.wire.frames import REQUEST_FRAME_BYTES, request_frames

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
    raw.send_frames(request_frames(raw.codec.encode(big), None))  # in 1 MiB frames, as a client sends
    assert error_of(raw.receive()) is p.ErrorCode.TOO_LARGE
    raw.send_frames([b"a", b"b"])
    assert error_of(raw.receive()) is p.ErrorCode.MALFORMED
    assert error_of(raw.request(p.Reserve(items=[(b"short", 10)]))) is p.ErrorCode.INVALID
    with server.client() as good:
        good.ping()


def test_a_frame_over_a_mib_closes_its_connection_unread_and_the_server_goes_on(
    server: ServerProcess,
) -> None:
    # libzmq refuses it from its size alone (MAXMSGSIZE), before buffering its bytes.
    raw = RawSocket(server.endpoint)
    try:
        raw.hello()
        raw.send_frames([b"\0" * (REQUEST_FRAME_BYTES + 1)])
        assert raw.receive(timeout_s=1.0) is None
    finally:
        raw.close()
    with server.client() as good:
        good.ping()
        with pytest.raises(ServerError, match="max_message_bytes") as err:
            good.put(key(2), b"\1" * (MiB + 1))  # refused before it is sent: the server's bound
        assert err.value.code == "too_large"
        good.ping()


def nested(depth: int) -> bytes:
    """A msgpack frame of ``depth`` nested one-element arrays (~``depth`` bytes)."""
    return b"\x91" * depth + b"\xc0"


@pytest.mark.parametrize("where", ["bare", "unknown field", "manifest"])
def test_a_frame_nested_past_the_decoders_depth_is_refused_and_the_loop_goes_on(
    server: ServerProcess, raw: RawSocket, where: str
) -> None:
    """A ~2 KiB frame nested 2,000 deep made the decoder raise RecursionError, which stopped the
    request loop for good (the process stayed up, answering nobody). Before the hello too: it is
    the first thing a stranger can send."""
    deep = nested(2000)
    frame = {
        "bare": deep,
        # {"op": "ping", "req_id": 3, "x": <deep>}
        "unknown field": b"\x83\xa2op\xa4ping\xa6req_id\x03\xa1x" + deep,
        # {"op": "register", "req_id": 4, "groups": [[0, {"m": <deep>}]]}
        "manifest": b"\x83\xa2op\xa8register\xa6req_id\x04\xa6groups\x91\x92\x00\x81\xa1m" + deep,
    }[where]
    assert error_of(raw.request(frame)) is p.ErrorCode.MALFORMED
    raw.hello()
    assert error_of(raw.request(frame)) is p.ErrorCode.MALFORMED
    with server.client() as good:
        good.ping()
        assert good.stats()["server"]["malformed"] == 2


def test_out_of_order_messages_are_refused_and_the_loop_goes_on(server: ServerProcess) -> None:
    with server.client() as alice, server.client() as bob:
        with pytest.raises(ServerError) as err:
            alice.commit([123456], [0])
        assert err.value.code == "unknown_token"

        assert alice.put(key(1), b"x" * 4096)
        [lease] = alice.pin([key(1)])
        assert lease is not None
        with pytest.raises(ServerError) as err:
            bob.release([lease.token])
        assert err.value.code == "not_owner"
        [slot] = bob.reserve([(key(2), 4096)])
        bob.arena().view(slot.offset, slot.nbytes)[:] = bytes(4096)
        with pytest.raises(ServerError) as err:
            alice.commit([slot.token], [digest(bytes(4096))])
        assert err.value.code == "not_owner"
        with pytest.raises(ServerError) as err:
            bob.commit([slot.token], [])  # no digest for the object
        assert err.value.code == "invalid"
        assert bob.commit([slot.token], [digest(bytes(4096))]) == 1
        with pytest.raises(ServerError) as err:
            bob.commit([slot.token], [digest(bytes(4096))])  # twice
        assert err.value.code == "unknown_token"
        assert alice.release([lease.token]) == 1
        with pytest.raises(ServerError):
            alice.lookup([b"h" * 16], [p.GroupRef(b"Z" * 16, 0)])  # never registered


def test_a_commit_naming_a_reservation_twice_is_refused_and_leaves_both_open(
    server: ServerProcess,
) -> None:
    with server.client() as bob:
        slots = bob.reserve([(key(3), 4096), (key(4), 4096)])
        for slot in slots:
            bob.arena().view(slot.offset, slot.nbytes)[:] = bytes(4096)
        first, second = (slot.token for slot in slots)
        with pytest.raises(ServerError) as err:
            bob.commit([first, first, second], [digest(bytes(4096))] * 3)
        assert err.value.code == "invalid"
        assert bob.commit([first, second], [digest(bytes(4096))] * 2) == 2
        leases = bob.pin([key(3), key(4)])
        assert all(leases)
        assert bob.release(list({lease.token for lease in leases if lease})) == 2  # objects


def test_a_release_naming_a_lease_twice_is_refused_and_leaves_both_held(server: ServerProcess) -> None:
    with server.client() as bob:
        slots = bob.reserve([(key(7), 4096), (key(8), 4096)])
        for slot in slots:
            bob.arena().view(slot.offset, slot.nbytes)[:] = bytes(4096)
        assert bob.commit([slot.token for slot in slots], [digest(bytes(4096))] * 2) == 2
        first, second = (lease.token for k in (7, 8) for lease in bob.pin([key(k)]) if lease)
        with pytest.raises(ServerError) as err:  # (Client.release would name each once)
            bob._call(p.Release(tokens=[first, second, first]))
        assert err.value.code == "invalid"
        assert bob.release_leases([first, second]) == set()  # both were still held, none expired


def test_a_reserve_of_a_size_outside_the_arena_is_refused_and_reserves_nothing(
    server: ServerProcess,
) -> None:
    with server.client() as bob:
        for nbytes in (1 << 40, -1):
            with pytest.raises(ServerError, match=f"cannot reserve {nbytes} bytes in an arena of") as err:
                bob.reserve([(key(5), 4096), (key(6), nbytes)])
            assert err.value.code == "invalid"
        [slot] = bob.reserve([(key(5), 4096)])  # nothing was left reserved for it
        bob.arena().view(slot.offset, slot.nbytes)[:] = bytes(4096)
        assert bob.commit([slot.token], [digest(bytes(4096))]) == 1


def test_version_mismatch_surfaces_as_a_protocol_error(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(p, "PROTOCOL_VERSION", p.PROTOCOL_VERSION + 1)
    with pytest.raises(ProtocolError, match="protocol"):
        server.client()


def test_a_silent_clients_reservations_and_leases_are_released(start_server: StartServer) -> None:
    # Its reservation's slot is then kept out of use for a while (the client may be stalled, not
    # dead, and write late): here a second.
    server = start_server(options={"heartbeat_timeout_s": 0.5}, l1_options={"quarantine_s": 1.0})
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
        assert stats["tiers"]["l1"]["quarantined"] == 1  # its reservation's slot, for the second
        wait_until(
            lambda: watcher.stats()["tiers"]["l1"]["bytes_used"] == 4096,
            what="only the committed object to remain once the quarantine ended",
        )
        # The heartbeating client was kept all along.
        watcher.ping()
        # The silent one comes back: it says hello again transparently.
        silent.ping()
        silent.close()


def test_the_fuzzed_server_still_serves_a_normal_client(server: ServerProcess, raw: RawSocket) -> None:
    """50 frames of random bytes (Hypothesis-fuzzed frames, with a good client working meanwhile:
    tests/reliability/test_bad_input.py), each answered or dropped with the session still served;
    then a new client registers as usual."""
    raw.hello()
    for _ in range(50):
        _replies, answer = raw.probe(os.urandom(64))
        assert isinstance(answer, p.Pong), answer
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        assert group.object_group == 0


def test_a_heartbeat_unanswered_while_the_server_is_stalled_keeps_the_session(
    start_server: StartServer,
) -> None:
    """A server stalled (here: stopped) for longer than the client's timeout but shorter than the
    heartbeat timeout leaves the client's session, and what it holds, alone: a heartbeat whose
    reply is late is no reason to start a new session (which orphaned every reservation and lease
    of the old one, and its next commit failed with ``unknown_token``)."""
    server = start_server(options={"heartbeat_timeout_s": 6.0})  # the client pings every 2 s of quiet
    client = server.client(timeout=0.3)
    try:
        [slot] = client.reserve([(key(3), 4096)])
        client.arena().view(slot.offset, slot.nbytes)[:] = bytes(4096)
        stop_process(server.process.pid)
        try:
            time.sleep(3.5)  # a ping goes out 2-3 s after the reserve, unanswered past 0.3 s
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        assert client.commit([slot.token], [digest(bytes(4096))], timeout=10) == 1
        assert client.get(key(3), timeout=10) is not None
    finally:
        client.close()


def test_a_request_loop_that_fails_anyway_stops_the_server_which_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should a bug end the request loop, the server stops (the arena unlinked, nothing left
    half-alive answering nobody) and serve_forever raises, so `tiercache server` exits 1 and a
    supervisor restarts it. The bug is planted in the loop's reading of requests."""
    from tiercache.config import L1Config, ServerOptions
    from tiercache.engine import TieredEngine
    from tiercache.l1.tier import L1Tier
    from tiercache.server import Server

    l1 = L1Tier(L1Config(size_bytes=1 << 20))
    server = Server(TieredEngine(l1), ServerOptions(listen=f"ipc://{tmp_path}/s.sock"))

    def planted_bug(sock: object) -> None:
        raise RuntimeError("planted bug")

    monkeypatch.setattr(server, "_read_requests", planted_bug)
    server.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(server.endpoint)
    sock.send(Codec().encode(p.Ping()))
    try:
        with pytest.raises(ServerError, match="request loop failed"):
            server.serve_forever()
    finally:
        sock.close()
        ctx.term()
    assert not l1.arena.path.exists()  # stopped and closed: the arena is gone


def test_a_request_naming_more_keys_than_the_bound_is_refused_and_others_are_served(
    server: ServerProcess,
) -> None:
    """One pin naming a key 1.7 million times held the request loop (every other client) for
    8-15 s and took as many leases; past --max-keys-per-request (16,384) a request is refused at
    once, naming the setting."""
    with server.client() as greedy, server.client() as other:
        assert greedy.put(key(1), b"z" * 4096)
        with pytest.raises(ServerError, match="max-keys-per-request") as err:
            greedy.pin([key(1)] * 20_000)  # within the frame bound, past the keys one
        assert err.value.code == "invalid"
        assert other.stats()["server"]["leases"] == 0  # nothing was pinned
        other.ping()
        assert len(greedy.pin([key(1)] * 1000)) == 1000  # within the bound: served as before
