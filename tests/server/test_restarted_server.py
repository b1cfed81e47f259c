"""Specification: a client keeps working across a restart of its server on the same endpoint.

A restarted server knows no session and answers ``hello_required``; the client says hello again and
sends the request once more, for synchronous calls and for the asynchronous requests a scheduler
polls (``lookup_async``, ``events_async``) alike: a restart is not an outage."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from tests.server.conftest import StartServer, manifest
from tests.server.test_data_path import prompt_hashes, store_prompt
from tiercache.client.transport import Transport
from tiercache.errors import ArenaError
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


def _waiting_in_hello(thread: threading.Thread) -> bool:
    """Whether ``thread`` has said its hello (a client that let it in) or waits inside
    :meth:`Transport.hello` for the client's lock: its innermost Python frame is ``hello`` itself,
    whose only wait is that lock (the round trip happens in frames below it)."""
    if not thread.is_alive():
        return True
    frame = sys._current_frames().get(thread.ident or -1)
    return frame is not None and frame.f_code is Transport.hello.__code__


def test_slots_come_with_the_arena_of_the_session_that_gave_them(
    start_server: StartServer, tmp_path: Path
) -> None:
    """A pin's slots are offsets in its server's arena. Another thread's hello to a restarted
    server, waiting while the pin is answered, must not make the client map the new arena for
    them (the same offsets hold other objects there): ``in_session`` keeps it out until the arena
    of the pin's own session is mapped."""
    listen = f"ipc://{tmp_path}/server.sock"
    first = start_server(listen=listen)
    client = first.client(heartbeat=False)
    try:
        [group] = client.register([(0, manifest())])
        stored = store_prompt(client, group, prompt_hashes(2))
        first_arena = client.server.arena_name
        keys = list(stored)
        hello = threading.Thread(target=client.hello)

        def pin_then_restart() -> list:
            slots = client.pin(keys)
            assert first.stop() == 0
            start_server(listen=listen)  # a new arena, and the same endpoint
            hello.start()
            wait_until(lambda: _waiting_in_hello(hello), timeout=10, what="the other thread's hello")
            return slots

        slots, arena = client.in_session(pin_then_restart)
        hello.join(timeout=30)
        assert not hello.is_alive()
        assert arena.name == first_arena != client.server.arena_name  # the hello came after
        for key, slot in zip(keys, slots):
            assert slot is not None
            try:
                assert bytes(arena.view(slot.offset, slot.nbytes)) == stored[key]
            except ArenaError:
                pass  # the hello unmapped it: a copy from it fails, it never reads the new arena
    finally:
        client.close()


def test_a_lookup_read_after_its_server_restarted_is_all_misses(
    start_server: StartServer, tmp_path: Path
) -> None:
    listen = f"ipc://{tmp_path}/server.sock"
    first = start_server(listen=listen)
    client = first.client(heartbeat=False)
    try:
        [group] = client.register([(0, manifest())])
        hashes = prompt_hashes(2)
        store_prompt(client, group, hashes)
        found = client.lookup(hashes, [group])
        assert found.chunks == 2 and found.arena == client.server.arena_name
        assert first.stop() == 0
        second = start_server(listen=listen)
        [again] = client.register([(0, manifest())])  # says hello to the new server
        assert client.server.arena_name != found.arena
        store_prompt(client, again, hashes)  # other bytes, maybe where the old slots were
        assert client.read_ticket(found) == {}
        assert second.process.is_alive()
    finally:
        client.close()
