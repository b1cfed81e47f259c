"""Specification: whatever frame comes back as a reply, the client raises one of its own errors
(a vLLM connector catches those, and only those), never a RecursionError out of the decoder.

Stand-in servers on ipc sockets answer the hello as a server would, then answer requests with
frames nested past the decoder's depth, forged unsigned frames on a signed session, or whatever a
fuzzer makes."""

from __future__ import annotations

import threading
from pathlib import Path

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.client.client import Client
from tiercache.errors import ProtocolError, TierCacheError
from tiercache.wire import protocol as p
from tiercache.wire.auth import SessionSeal, session_key
from tiercache.wire.codec import Codec


def _stand_in(sock: zmq.Socket[bytes], done: threading.Event) -> None:
    codec = Codec()
    while not done.is_set():
        if not sock.poll(50):
            continue
        identity, frame = sock.recv_multipart()
        msg = codec.requests.decode(frame)
        if isinstance(msg, p.Hello):
            hello = stand_in_hello_reply(msg.req_id)
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
    codec = Codec()
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
            reply: p.Message = stand_in_hello_reply(msg.req_id)
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


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_reply_ops = [*sorted(str(t.__struct_config__.tag) for t in p.Reply.__args__), "nonsense"]
_reply_maps = st.fixed_dictionaries(
    {"op": st.sampled_from(_reply_ops), "req_id": st.integers(-(2**63), 2**64 - 1)},
    optional={"chunks": _values, "slots": _values, "code": _values, "message": _values, "data": _values},
)
_nested = st.integers(1000, 3000).map(lambda depth: b"\x91" * depth + b"\xc0")
_frames = (
    st.binary(max_size=64)
    | _values.map(msgspec.msgpack.encode)
    | _reply_maps.map(msgspec.msgpack.encode)
    | _nested
)


def _fuzzing_stand_in(sock: zmq.Socket[bytes], done: threading.Event, queue: list[bytes]) -> None:
    """Answers the hello as a server would, then each request with the next queued frame and then
    its real reply."""
    codec = Codec()
    while not done.is_set():
        if not sock.poll(50):
            continue
        identity, body = sock.recv_multipart()
        msg = codec.requests.decode(body)
        if isinstance(msg, p.Hello):
            sock.send_multipart([identity, codec.encode(stand_in_hello_reply(msg.req_id))])
            continue
        sock.send_multipart([identity, queue.pop(0)])
        sock.send_multipart([identity, codec.encode(p.Pong(req_id=msg.req_id))])


def stand_in_hello_reply(req_id: int) -> p.HelloReply:
    """What a server's hello reply says, from a stand-in with no arena."""
    return p.HelloReply(
        req_id=req_id,
        protocol_version=p.PROTOCOL_VERSION,
        server_version="stand-in",
        chunk_size=256,
        separate_object_groups=True,
        arena_name="tiercache-none",
        arena_size=1,
        heartbeat_timeout_s=15.0,
        max_message_bytes=1 << 20,
    )


def test_whatever_frame_comes_back_the_client_raises_only_its_own_errors(tmp_path: Path) -> None:
    """The vLLM connector and the SGLang backend catch TierCacheError, and only that: no reply may
    raise anything else out of a client call."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    endpoint = f"ipc://{tmp_path}/stand-in.sock"
    sock.bind(endpoint)
    done = threading.Event()
    queue: list[bytes] = []
    thread = threading.Thread(target=_fuzzing_stand_in, args=(sock, done, queue), daemon=True)
    thread.start()
    outcomes: dict[str, int] = {}
    try:
        with Client(endpoint, timeout=2, heartbeat=False) as client:

            @settings(max_examples=200, deadline=None)
            @given(frame=_frames)
            def answer_with(frame: bytes) -> None:
                queue.append(frame)
                try:
                    client.ping()
                    outcomes["ok"] = outcomes.get("ok", 0) + 1
                except TierCacheError as exc:
                    outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1

            answer_with()
    finally:
        done.set()
        thread.join(5)
        sock.close()
        ctx.term()
    print(f"\n[forged replies] outcomes {outcomes}")
    assert outcomes.get("ProtocolError", 0) > 0  # the fuzzer did reach the decoder's failures
