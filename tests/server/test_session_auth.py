"""Specification: on a shared-secret server over tcp, a session belongs to the connection that proved
the secret. Copying its routing id (it travels in the clear) or replaying its recorded requests gets
nothing of it: no reply or an error, nothing stored, nothing cleared; the real client keeps working.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.auth

from tests.server.conftest import StartServer, curve_keys, manifest
from tiercache.client.client import Client
from tiercache.client.wires import ZmqWire
from tiercache.errors import AuthenticationError
from tiercache.keys import Fingerprint, ObjectKey, chunk_hashes
from tiercache.wire import protocol as p
from tiercache.wire.auth import SessionSeal, auth_proof, session_key
from tiercache.wire.codec import Codec
from tiercache.wire.frames import request_frames

SECRET = "s3cret-of-the-node-0f9a27c4e1b8d6"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Peer:
    """A bare DEALER with a chosen routing id, speaking the protocol by hand: what an attacker (or a
    recording of a real client) puts on the wire."""

    def __init__(self, endpoint: str, identity: bytes) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.setsockopt(zmq.ROUTING_ID, identity)
        self.sock.connect(endpoint)
        self.codec = Codec()
        self.seal: SessionSeal | None = None
        self.sent: list[list[bytes]] = []  # every request as it went on the wire

    def send(self, msg: p.Message, *, sign: bool = True) -> None:
        body = self.codec.encode(msg)
        frames = [
            bytes(f)
            for f in request_frames(body, None if self.seal is None or not sign else self.seal.seal(body))
        ]
        self.sent.append(frames)
        self.sock.send_multipart(frames)

    def replay(self, frames: list[bytes]) -> p.Message | None:
        self.sock.send_multipart(frames)
        return self.receive()

    def receive(self, timeout_s: float = 1.5) -> p.Message | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return msgspec.msgpack.decode(self.sock.recv_multipart()[0], type=p.Reply)

    def request(self, msg: p.Message, *, sign: bool = True) -> p.Message | None:
        self.send(msg, sign=sign)
        return self.receive()

    def login(self, secret: str) -> None:
        challenge = self.request(p.Challenge())
        assert isinstance(challenge, p.ChallengeReply)
        client_nonce = secrets.token_bytes(16)
        hello = p.Hello(
            protocol_version=p.PROTOCOL_VERSION,
            auth=auth_proof(secret, challenge.nonce),
            client_nonce=client_nonce,
        )
        self.seal = SessionSeal(session_key(secret, challenge.nonce, client_nonce), to_server=True)
        assert isinstance(self.request(hello), p.HelloReply)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def endpoint(start_server: StartServer) -> str:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    start_server(listen=endpoint, options={"auth_secret": SECRET}, client_kw={"auth_secret": SECRET})
    return endpoint


@pytest.fixture
def peers(endpoint: str) -> Iterator[list[Peer]]:
    made: list[Peer] = []
    yield made
    for peer in made:
        peer.close()


def keys(client: Client, n: int, seed: int) -> list[ObjectKey]:
    [group] = client.register([(0, manifest())])
    hashes = chunk_hashes(list(range(seed, seed + 256 * n)), 256)
    return [ObjectKey(Fingerprint(group.fingerprint), group.object_group, h) for h in hashes]


def routing_id(client: Client) -> bytes:
    wire = client._state.wire
    assert isinstance(wire, ZmqWire)
    return wire.routing_id


def test_a_connection_that_copies_a_logged_in_clients_id_gets_nothing(
    endpoint: str, peers: list[Peer]
) -> None:
    with Client(endpoint, timeout=5, auth_secret=SECRET) as victim:
        kept, planted = keys(victim, 2, seed=1)
        assert victim.put(kept, b"the victim's chunk")
        attacker = Peer(endpoint, routing_id(victim))
        peers.append(attacker)
        replies = [
            attacker.request(p.Stats(req_id=1)),
            attacker.request(p.Put(req_id=2, key=planted.to_bytes(), data=b"poison")),
            attacker.request(p.Clear(req_id=3)),
        ]
        # Turned away (no reply) or refused: never a stats reply, never "done".
        assert all(r is None or isinstance(r, p.ErrorReply) for r in replies), replies
        victim.ping()  # the real client keeps its connection and its session
        assert victim.get(kept) == b"the victim's chunk"
    with Client(endpoint, timeout=5, auth_secret=SECRET) as fresh:
        assert fresh.get(planted) is None  # nothing planted
        assert fresh.get(kept) == b"the victim's chunk"  # nothing cleared


def test_a_request_signed_for_a_session_is_refused_when_replayed(endpoint: str, peers: list[Peer]) -> None:
    identity = b"tc-" + os.urandom(12)
    real = Peer(endpoint, identity)
    peers.append(real)
    real.login(SECRET)
    with Client(endpoint, timeout=5, auth_secret=SECRET) as admin:
        [key] = keys(admin, 1, seed=7)
        assert isinstance(real.request(p.Put(req_id=1, key=key.to_bytes(), data=b"v1")), p.Done)
        recorded_put = real.sent[-1]
        assert isinstance(real.request(p.Delete(req_id=2, key=key.to_bytes())), p.Done)
        assert admin.get(key) is None

        # The real connection goes; its session stays until the heartbeat timeout. An eavesdropper
        # who recorded the put takes the id over and plays it back, then tries its own requests.
        real.close()
        peers.remove(real)
        attacker = Peer(endpoint, identity)
        peers.append(attacker)
        replayed = attacker.replay(recorded_put)
        assert isinstance(replayed, p.ErrorReply) and replayed.code is p.ErrorCode.AUTH_FAILED, replayed
        unsigned = attacker.request(p.Clear(req_id=9))
        assert isinstance(unsigned, p.ErrorReply) and unsigned.code is p.ErrorCode.AUTH_FAILED, unsigned
        forged_tag = [attacker.codec.encode(p.Clear(req_id=10)), recorded_put[1]]
        refused = attacker.replay(forged_tag)
        assert isinstance(refused, p.ErrorReply) and refused.code is p.ErrorCode.AUTH_FAILED, refused
        assert admin.get(key) is None  # the replayed put stored nothing
        assert admin.stats()["server"]["refused_unsigned"] >= 3

        # From another connection the recording names no session at all.
        stranger = Peer(endpoint, b"tc-" + os.urandom(12))
        peers.append(stranger)
        elsewhere = stranger.replay(recorded_put)
        assert isinstance(elsewhere, p.ErrorReply) and elsewhere.code is p.ErrorCode.HELLO_REQUIRED


def test_a_request_over_a_frame_is_signed_across_all_its_frames(endpoint: str, peers: list[Peer]) -> None:
    with Client(endpoint, timeout=5, auth_secret=SECRET) as owner:
        [kept, tampered] = keys(owner, 2, seed=7)
    peer = Peer(endpoint, b"\0frames-peer")
    peers.append(peer)
    peer.login(SECRET)
    data = bytes(range(256)) * (3 * 4096 + 7)  # 3 MiB and more: four body frames, then the tag
    assert peer.request(p.Put(req_id=1, key=kept.to_bytes(), data=data)) == p.Done(req_id=1, count=1)
    assert isinstance(peer.seal, SessionSeal)
    body = peer.codec.encode(p.Put(req_id=2, key=tampered.to_bytes(), data=data))
    frames = [bytes(f) for f in request_frames(body, peer.seal.seal(body))]
    assert len(frames) == 5
    frames[2] = frames[2][:-1] + bytes([frames[2][-1] ^ 1])  # one bit of a middle frame
    refused = peer.replay(frames)
    assert isinstance(refused, p.ErrorReply) and refused.code is p.ErrorCode.AUTH_FAILED
    with Client(endpoint, timeout=5, auth_secret=SECRET) as reader:
        assert reader.get(kept) == data
        assert reader.get(tampered) is None


def test_a_client_with_the_secret_does_not_believe_a_server_that_cannot_prove_it(
    start_server: StartServer,
) -> None:
    server = start_server()  # owner-only ipc, no secret: it answers the hello unsigned
    with pytest.raises(AuthenticationError, match="without proving the shared secret"):
        Client(server.endpoint, timeout=1, heartbeat=False, auth_secret=SECRET)


def test_curve_with_a_shared_secret_signs_sessions_too(start_server: StartServer, tmp_path: Path) -> None:
    certs = curve_keys(tmp_path / "keys")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    curve = {"curve_server_key": certs.server_public, "curve_client_key_file": certs.client_secret_file}
    start_server(
        listen=endpoint,
        options={"curve_secret_key_file": certs.server_secret_file, "auth_secret": SECRET},
        client_kw={**curve, "auth_secret": SECRET},
    )
    with Client(endpoint, timeout=5, auth_secret=SECRET, **curve) as client:  # type: ignore[arg-type]
        [key] = keys(client, 1, seed=3)
        assert client.put(key, b"over curve")
        assert client.get(key) == b"over curve"
        assert client.stats()["server"]["refused_unsigned"] == 0
