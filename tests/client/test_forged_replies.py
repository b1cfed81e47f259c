"""Specification: whatever frame comes back as a reply, the client raises one of its own errors
(a vLLM connector catches those, and only those), never a RecursionError out of the decoder.

A stand-in server on an ipc socket answers the hello as a server would, then answers the next
request with a frame whose one unknown field is nested 2,000 deep."""

from __future__ import annotations

import threading
from pathlib import Path

import msgspec
import pytest
import zmq

from tiercache.client.client import Client
from tiercache.errors import ProtocolError
from tiercache.wire import protocol as p
from tiercache.wire.auth import SessionSeal, session_key


def _stand_in(sock: zmq.Socket[bytes], done: threading.Event) -> None:
    codec = p.Codec()
    while not done.is_set():
        if not sock.poll(50):
            continue
        identity, frame = sock.recv_multipart()
        msg = codec.requests.decode(frame)
        if isinstance(msg, p.Hello):
            hello = p.HelloReply(
                req_id=msg.req_id,
                protocol_version=p.PROTOCOL_VERSION,
                server_version="stand-in",
                chunk_size=256,
                separate_object_groups=True,
                arena_name="tiercache-none",
                arena_size=1,
                heartbeat_timeout_s=15.0,
                max_message_bytes=1 << 20,
            )
            sock.send_multipart([identity, codec.encode(hello)])
        else:  # {"op": "pong", "req_id": N, "x": [[[...]]]}: the nesting in a field it skips
            head = b"\x83\xa2op\xa4pong\xa6req_id" + msgspec.msgpack.encode(msg.req_id) + b"\xa1x"
            sock.send_multipart([identity, head + b"\x91" * 2000 + b"\xc0"])


def test_a_reply_nested_past_the_decoders_depth_is_a_protocol_error(tmp_path: Path) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    endpoint = f"ipc://{tmp_path}/stand-in.sock"
    sock.bind(endpoint)
    done = threading.Event()
    thread = threading.Thread(target=_stand_in, args=(sock, done), daemon=True)
    thread.start()
    try:
        with Client(endpoint, timeout=5, heartbeat=False) as client, pytest.raises(ProtocolError):
            client.ping()
    finally:
        done.set()
        thread.join(5)
        sock.close()
        ctx.term()


SECRET = "a-secret-of-the-stand-in-0f9a27c4e1b8d6a3"


def _signed_stand_in(sock: zmq.Socket[bytes], done: threading.Event) -> None:
    """A server with the secret that answers each ping with a forged unsigned frame nested past the
    decoder's depth (what anyone on the path could inject), then with its real, signed pong."""
    codec = p.Codec()
    nonce = b"n" * 16
    seal: SessionSeal | None = None
    while not done.is_set():
        if not sock.poll(50):
            continue
        identity, body, *_tag = sock.recv_multipart()
        msg = codec.requests.decode(body)
        if isinstance(msg, p.Challenge):
            sock.send_multipart([identity, codec.encode(p.ChallengeReply(req_id=msg.req_id, nonce=nonce))])
            continue
        if isinstance(msg, p.Hello):
            seal = SessionSeal(session_key(SECRET, nonce, msg.client_nonce), to_server=False)
            reply: p.Message = p.HelloReply(
                req_id=msg.req_id,
                protocol_version=p.PROTOCOL_VERSION,
                server_version="stand-in",
                chunk_size=256,
                separate_object_groups=True,
                arena_name="tiercache-none",
                arena_size=1,
                heartbeat_timeout_s=15.0,
                max_message_bytes=1 << 20,
            )
        else:
            forged = b"\x83\xa2op\xa4pong\xa6req_id" + msgspec.msgpack.encode(msg.req_id) + b"\xa1x"
            sock.send_multipart([identity, forged + b"\x91" * 8000 + b"\xc0"])
            reply = p.Pong(req_id=msg.req_id)
        assert seal is not None
        encoded = codec.encode(reply)
        sock.send_multipart([identity, encoded, seal.seal(encoded)])


def test_on_a_signed_session_a_forged_reply_is_dropped_before_it_is_decoded(tmp_path: Path) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    endpoint = f"ipc://{tmp_path}/stand-in.sock"
    sock.bind(endpoint)
    done = threading.Event()
    thread = threading.Thread(target=_signed_stand_in, args=(sock, done), daemon=True)
    thread.start()
    try:
        with Client(endpoint, timeout=5, heartbeat=False, auth_secret=SECRET) as client:
            client.ping()  # the forged frame first: too large to be a refusal, and unsigned
            assert client._state.unsigned_replies == 1
    finally:
        done.set()
        thread.join(5)
        sock.close()
        ctx.term()
