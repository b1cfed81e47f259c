"""Specification: a client keeps working across a restart of its server on the same endpoint.

A restarted server knows no session and answers ``hello_required``; the client says hello again and
sends the request once more, for synchronous calls and for the asynchronous requests a scheduler
polls (``lookup_async``, ``events_async``) alike: a restart is not an outage."""

from __future__ import annotations

from pathlib import Path

from tests.server.conftest import StartServer, manifest
from tests.server.test_data_path import prompt_hashes, store_prompt
from tiercache.testing.poll import wait_until
from tiercache.wire.protocol import LookupReply


def test_async_requests_survive_a_server_restart(start_server: StartServer, tmp_path: Path) -> None:
    listen = f"ipc://{tmp_path}/server.sock"
    disk = str(tmp_path / "lmdb")
    first = start_server(listen=listen, disk_path=disk)
    client = first.client(heartbeat=False)  # no heartbeat: its first message after the restart is ours
    try:
        [group] = client.register([(0, manifest())])
        hashes = prompt_hashes(2)
        store_prompt(client, group, hashes)
        assert first.stop() == 0  # flushes to disk
        second = start_server(listen=listen, disk_path=disk)
        req = client.lookup_async(hashes, [group], prefetch=False)
        reply = wait_until(lambda: client.poll(req), timeout=10, what="the lookup's reply")
        assert isinstance(reply, LookupReply) and reply.chunks == 2  # from the disk, after a new hello
        events = client.events_async()
        assert wait_until(lambda: client.poll(events), timeout=10, what="the events reply").instance
        assert second.process.is_alive()
    finally:
        client.close()
