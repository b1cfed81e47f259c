"""Specification: a server listening on ``unix://`` serves clients as on ``ipc://``, over a Unix
stream socket its request loop reads itself, and bounds what any peer costs it as ``ipc://`` does.

Each message is a header (the body's and the tag's lengths), the body and the tag. A message larger
than its sender may send is refused from its header, before a byte of it is read, and its
connection closed; a peer that stops reading its replies is disconnected once they pass a bound;
a message cut short or undecodable costs its sender only. A request whose connection the server
closes before answering it fails at once."""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import socket
import stat
import struct
import tempfile
import threading
from pathlib import Path

import pytest

from tests.client.test_forged_replies import stand_in_hello_reply
from tests.server.conftest import StartServer, manifest
from tests.server.test_data_path import prompt_hashes, store_prompt
from tiercache.cli.app import main as cli_main
from tiercache.client.client import Client
from tiercache.errors import ServerUnavailableError
from tiercache.keys import Fingerprint, ObjectKey
from tiercache.server import unix
from tiercache.testing.poll import wait_until
from tiercache.wire import protocol as p
from tiercache.wire.codec import Codec
from tiercache.wire.stream import JOIN_BYTES, STREAM_HEADER, stream_message, stream_pieces

MiB = 1 << 20


def unix_endpoint(tmp_path: Path, name: str = "server") -> str:
    return f"unix://{tmp_path}/run/{name}.sock"


def raw_connect(endpoint: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(endpoint.removeprefix("unix://"))
    return sock


def raw_reply(sock: socket.socket) -> p.Message | None:
    """The next reply on ``sock``, decoded; ``None`` if the server closed the connection first."""
    inbox = b""
    while True:
        if len(inbox) >= STREAM_HEADER.size:
            body_len, tag_len = STREAM_HEADER.unpack_from(inbox)
            if len(inbox) >= STREAM_HEADER.size + body_len + tag_len:
                return Codec().replies.decode(inbox[STREAM_HEADER.size : STREAM_HEADER.size + body_len])
        data = sock.recv(65536)
        if not data:
            return None
        inbox += data


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_client_over_unix_stores_looks_up_and_loads_identical_bytes(
    start_server: StartServer, tmp_path: Path
) -> None:
    endpoint = unix_endpoint(tmp_path)
    server = start_server(listen=endpoint)
    path = Path(endpoint.removeprefix("unix://"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # owner-only, as an ipc socket
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    with server.client() as client:
        [group] = client.register([(0, manifest())])
        hashes = prompt_hashes(8)
        stored = store_prompt(client, group, hashes)
        found = client.lookup(hashes, [group])
        assert found.chunks == 8 and found.state is p.TicketStateName.READY
        assert client.read_ticket(found) == stored
        keys = list(stored)
        assert client.load_chunks(keys) == [stored[k] for k in keys]
        # A body of several MiB: read in pieces by the loop, and its reply sent in pieces.
        key = ObjectKey(Fingerprint(group.fingerprint), 0, prompt_hashes(1, seed=9)[0])
        data = os.urandom(9 * MiB + 3)
        assert client.put(key, data)
        assert client.get(key) == data


def test_a_session_with_a_shared_secret_signs_every_message_over_unix(
    start_server: StartServer, tmp_path: Path
) -> None:
    secret = "s3cret-8d1e5a0c7b3f9264"
    endpoint = unix_endpoint(tmp_path)
    start_server(listen=endpoint, options={"auth_secret": secret}, client_kw={"auth_secret": secret})
    with Client(endpoint, timeout=5, auth_secret=secret) as client:
        client.ping()
        assert client.stats()["server"]["refused_unsigned"] == 0
    sock = raw_connect(endpoint)
    ping = Codec().encode(p.Ping(req_id=7))
    sock.sendall(b"".join(stream_message(ping, None)))
    refused = raw_reply(sock)
    assert isinstance(refused, p.ErrorReply) and refused.code is p.ErrorCode.HELLO_REQUIRED


def test_a_strangers_oversized_message_is_refused_from_its_header_and_its_connection_closed(
    start_server: StartServer, tmp_path: Path
) -> None:
    endpoint = unix_endpoint(tmp_path)
    server = start_server(listen=endpoint)
    sock = raw_connect(endpoint)
    sock.sendall(STREAM_HEADER.pack(1 << 30, 0) + b"\x91" * 4096)  # says 1 GiB; no session
    refused = raw_reply(sock)
    assert isinstance(refused, p.ErrorReply) and refused.code is p.ErrorCode.HELLO_REQUIRED
    assert "dropped unread" in refused.message
    assert closed_by_server(sock)
    with server.client() as client:
        assert client.stats()["server"]["stranger_frames"] == 1


def test_garbage_and_a_message_cut_short_cost_only_their_sender(
    start_server: StartServer, tmp_path: Path
) -> None:
    endpoint = unix_endpoint(tmp_path)
    server = start_server(listen=endpoint)
    garbage = raw_connect(endpoint)
    garbage.sendall(b"".join(stream_message(b"\xc1\xff not msgpack", None)))
    malformed = raw_reply(garbage)
    assert isinstance(malformed, p.ErrorReply) and malformed.code is p.ErrorCode.MALFORMED
    short = raw_connect(endpoint)
    short.sendall(STREAM_HEADER.pack(100, 0)[:5])  # half a header, then gone
    short.close()
    cut = raw_connect(endpoint)
    cut.sendall(STREAM_HEADER.pack(100, 0) + b"\x00" * 10)  # a tenth of a body, then gone
    cut.close()
    with server.client() as client:
        client.ping()
        assert client.stats()["server"]["malformed"] == 1


def test_a_peer_that_does_not_read_its_replies_holds_nobody_else(
    start_server: StartServer, tmp_path: Path
) -> None:
    endpoint = unix_endpoint(tmp_path)
    server = start_server(listen=endpoint)
    deaf = raw_connect(endpoint)
    deaf.setblocking(False)
    ping = b"".join(stream_message(Codec().encode(p.Ping(req_id=1)), None))
    sent = 0
    try:
        while sent < MiB:  # its replies fill both socket buffers; then the server queues them
            sent += deaf.send(ping * 512)
    except BlockingIOError:
        pass  # the server reads no faster than this peer reads its replies
    with server.client(timeout=5) as client:
        for _ in range(50):
            client.ping()  # each answered within the client's timeout, or it raises


def test_replies_a_peer_leaves_unread_past_the_bound_end_its_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(unix, "MAX_UNSENT_BYTES", 4 * MiB)
    poller = unix.EpollPoller()
    listener = unix.UnixListener(tmp_path / "l.sock", poller)
    try:
        peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        peer.connect(str(tmp_path / "l.sock"))

        def accepted() -> dict[bytes, unix.Connection]:
            listener.accept()
            return listener.connections

        wait_until(accepted, timeout=5, what="the connection")
        [conn] = listener.connections.values()
        body = b"x" * MiB
        sends = 0
        while listener.send(conn.identity, body, None):
            sends += 1
            assert sends < 64, "the connection was never closed"
        assert conn.identity not in listener.connections and not listener.by_fd
        assert sends >= 4  # what the socket buffers took, then the 4 MiB queued
        peer.settimeout(5)
        while peer.recv(MiB):  # the replies the socket held come first, then the end
            pass
    finally:
        listener.close_all()
        poller.close()
    assert not (tmp_path / "l.sock").exists()


def test_a_connection_from_another_user_is_closed_unread(start_server: StartServer, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: a process of another user is made by switching to uid 65534")
    shared = Path(tempfile.mkdtemp(prefix="tiercache-unix-"))  # (pytest's own tmp is root-only)
    try:
        path = shared / "server.sock"
        server = start_server(listen=f"unix://{path}")
        os.chmod(shared, 0o777)  # loosened by hand: the uid check still holds
        os.chmod(path, 0o777)
        child = os.fork()
        if child == 0:  # the other user
            try:
                os.setuid(65534)
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(5)
                sock.connect(str(path))
                os._exit(0 if closed_by_server(sock) else 1)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        with server.client() as client:
            assert client.stats()["server"]["connections_refused"] == 1
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_client_says_hello_again_to_a_restarted_server_on_the_same_unix_path(
    start_server: StartServer, tmp_path: Path
) -> None:
    endpoint = unix_endpoint(tmp_path)
    disk = str(tmp_path / "lmdb")
    first = start_server(listen=endpoint, disk_path=disk)
    client = first.client(heartbeat=False)
    try:
        [group] = client.register([(0, manifest())])
        hashes = prompt_hashes(2)
        store_prompt(client, group, hashes)
        assert first.stop() == 0
        with pytest.raises(ServerUnavailableError, match="cannot connect"):
            client.ping()  # nobody listens: said at once, not after the timeout
        start_server(listen=endpoint, disk_path=disk)
        assert client.lookup(hashes, [group], prefetch=False).chunks == 2  # from the disk, after a hello
    finally:
        client.close()


def test_a_client_that_goes_away_takes_what_it_held_with_it_at_once(
    start_server: StartServer, tmp_path: Path
) -> None:
    endpoint = unix_endpoint(tmp_path)
    server = start_server(listen=endpoint, options={"heartbeat_timeout_s": 60.0})
    with server.client() as writer:
        [group] = writer.register([(0, manifest())])
        hashes = prompt_hashes(4)
        store_prompt(writer, group, hashes)
    with server.client() as observer:
        gone = server.client()
        [group] = gone.register([(0, manifest())])
        found = gone.lookup(hashes, [group])  # a ticket holding the four objects
        assert found.state is p.TicketStateName.READY
        assert observer.stats()["server"]["tickets"] == 1
        gone.close()  # no release: its connection ends, and the server sees it end

        def released() -> dict[str, int] | None:
            now = observer.stats()["server"]
            return now if now["tickets"] == 0 else None

        after = wait_until(
            released,
            timeout=5,
            what="the ticket released with its connection (not 60 s later, at its timeout)",
        )
        assert after is not None and after["clients_disconnected"] >= 2 and after["clients_expired"] == 0


class HangsUpAfterHello:
    """A listener that answers every hello as a server would and closes the connection on any other
    request, unanswered: a server stopping or restarting under a client. With ``hang_ups``, it
    does so on that many connections only; on the later ones it answers pings, and asks for a hello
    first, as a restarted server does."""

    def __init__(self, path: Path, hang_ups: int | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._hang_ups = hang_ups
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(8)
        self.hung_up = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        codec = Codec()
        for served in itertools.count():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            hangs_up = self._hang_ups is None or served < self._hang_ups
            said_hello = False
            with conn:
                inbox = b""
                while data := conn.recv(65536):
                    inbox += data
                    while len(inbox) >= STREAM_HEADER.size:
                        body_len, tag_len = STREAM_HEADER.unpack_from(inbox)
                        end = STREAM_HEADER.size + body_len + tag_len
                        if len(inbox) < end:
                            break
                        msg = codec.requests.decode(inbox[STREAM_HEADER.size : STREAM_HEADER.size + body_len])
                        inbox = inbox[end:]
                        reply: p.Message
                        if isinstance(msg, p.Hello):
                            said_hello, reply = True, stand_in_hello_reply(msg.req_id)
                        elif hangs_up:
                            self.hung_up += 1
                            break
                        elif not said_hello:
                            reply = p.ErrorReply(
                                req_id=msg.req_id, code=p.ErrorCode.HELLO_REQUIRED, message="hello first"
                            )
                        else:
                            reply = p.Pong(req_id=msg.req_id)
                        conn.sendall(b"".join(stream_message(codec.encode(reply), None)))
                    else:
                        continue
                    break  # a request it will not answer: hang up

    def close(self) -> None:
        self._listener.close()


def test_requests_in_flight_when_the_server_closes_the_connection_fail_at_once_not_at_the_timeout(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run" / "server.sock"
    server = HangsUpAfterHello(path)
    client = Client(f"unix://{path}", timeout=30, heartbeat=False)  # says hello
    try:
        group = p.GroupRef(fingerprint=bytes(16), object_group=0)
        asked = client.lookup_async(prompt_hashes(2), [group])
        # Within one poll's wait, far inside the 30 s timeout (a poll that only timed out would
        # return None, and one at the timeout would say "no reply").
        with pytest.raises(ServerUnavailableError, match="closed the connection before answering"):
            client.poll(asked, wait_s=10.0)
        with pytest.raises(ServerUnavailableError, match="closed the connection before answering"):
            client.ping()  # a new connection and hello, then the same hang-up: said at once too
        assert server.hung_up == 2
    finally:
        client.close()
        server.close()


def test_requests_sent_before_the_server_restarted_fail_at_once_when_the_next_request_reconnects(
    tmp_path: Path,
) -> None:
    """The client may send its next request before it reads that the server closed the
    connection (a lookup still in flight, not polled yet): that request goes on a new connection
    and is served, and the lookup sent on the old one, which nobody will answer, fails at once."""
    path = tmp_path / "run" / "server.sock"
    server = HangsUpAfterHello(path, hang_ups=1)
    client = Client(f"unix://{path}", timeout=30, heartbeat=False)  # says hello
    try:
        group = p.GroupRef(fingerprint=bytes(16), object_group=0)
        asked = client.lookup_async(prompt_hashes(2), [group])
        wait_until(lambda: server.hung_up == 1, timeout=10, what="the server to hang up")
        client.ping()  # on a new connection, after a hello: answered
        # Already failed (a poll that only timed out would return None).
        with pytest.raises(ServerUnavailableError, match="closed the connection before answering"):
            client.poll(asked, wait_s=10.0)
    finally:
        client.close()
        server.close()


def test_a_zeromq_client_given_a_unix_servers_socket_is_told_to_use_unix_and_the_server_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """A client given ``ipc://`` for a ``unix://`` server's socket (a config written before
    ``unix://`` became the default) speaks ZeroMQ, which the server cannot read. The server closes
    each such connection and warns once, naming the fix; the client's hello, unanswered, ends in an
    error that names the endpoint to use, not a bare "is it running?"."""
    from tiercache.config import L1Config, ServerOptions
    from tiercache.engine import TieredEngine
    from tiercache.l1.tier import L1Tier
    from tiercache.server import Server

    path = tmp_path / "run" / "server.sock"
    server = Server(
        TieredEngine(L1Tier(L1Config(size_bytes=1 * MiB))), ServerOptions(listen=f"unix://{path}")
    )
    with server, caplog.at_level("WARNING", logger="tiercache.server.unix"):
        assert cli_main(["inspect", "summary", "--server", f"unix://{path}"]) == 0
        assert "connections closed from another user 0, for speaking ZeroMQ 0\n" in capsys.readouterr().out
        with pytest.raises(
            ServerUnavailableError,
            match=f"listens on unix://{path}, not ipc://{path}: connect with unix://{path}",
        ):
            Client(f"ipc://{path}", timeout=1.0, heartbeat=False)
        with Client(f"unix://{path}", timeout=10, heartbeat=False) as client:  # the right scheme is served
            closed = client.stats()["server"]["zmq_connections_closed"]
        assert cli_main(["inspect", "summary", "--server", f"unix://{path}"]) == 0
        out = " ".join(capsys.readouterr().out.split())
    assert closed >= 2  # the client's (which ZeroMQ reconnects) and the probe's
    assert f"for speaking ZeroMQ {closed} (clients given ipc:// for this unix:// socket" in out
    warnings = [r.getMessage() for r in caplog.records if "speaks ZeroMQ" in r.getMessage()]
    assert len(warnings) == 1, warnings  # one process: told once
    assert f"point that client at unix://{path}" in warnings[0] and f"pid {os.getpid()}" in warnings[0]


def test_a_zeromq_client_with_a_shared_secret_is_told_to_use_unix_too(tmp_path: Path) -> None:
    """With a shared secret the client's first message is the challenge, not the hello: its
    timeout names the endpoint to use all the same."""
    from tiercache.config import L1Config, ServerOptions
    from tiercache.engine import TieredEngine
    from tiercache.l1.tier import L1Tier
    from tiercache.server import Server

    secret = secrets.token_hex(32)
    path = tmp_path / "run" / "server.sock"
    options = ServerOptions(listen=f"unix://{path}", auth_secret=secret)
    with Server(TieredEngine(L1Tier(L1Config(size_bytes=1 * MiB))), options):
        with pytest.raises(ServerUnavailableError, match=f"connect with unix://{path}"):
            Client(f"ipc://{path}", timeout=1.0, heartbeat=False, auth_secret=secret)
        with Client(f"unix://{path}", timeout=10, heartbeat=False, auth_secret=secret) as client:
            client.ping()


def test_a_unix_client_given_a_zeromq_servers_socket_is_told_to_use_ipc_at_once(
    start_server: StartServer, tmp_path: Path
) -> None:
    """The other way round: a ZeroMQ server greets every connection first, which no reply of a
    ``unix://`` server can begin with; the client's call fails at once, naming the endpoint to use."""
    path = tmp_path / "zmq" / "server.sock"
    start_server(listen=f"ipc://{path}")
    with pytest.raises(
        ServerUnavailableError, match=f"speaks ZeroMQ: it listens on ipc://{path}, not unix://{path}"
    ):
        Client(f"unix://{path}", timeout=30, heartbeat=False)  # its hello (at the timeout: "no reply")


def test_stream_header_is_two_big_endian_lengths() -> None:
    assert STREAM_HEADER.size == 8
    assert stream_message(b"body", b"tag") == [struct.pack(">II", 4, 3), b"body", b"tag"]
    assert stream_message(b"body", None) == [struct.pack(">II", 4, 0), b"body"]


def test_a_small_message_is_sent_in_one_piece_and_a_large_body_is_not_copied() -> None:
    assert stream_pieces(b"body", b"tag") == [struct.pack(">II", 4, 3) + b"body" + b"tag"]
    large = bytes(JOIN_BYTES + 1)
    header, body = stream_pieces(large, None)
    assert header == struct.pack(">II", JOIN_BYTES + 1, 0) and body is large
