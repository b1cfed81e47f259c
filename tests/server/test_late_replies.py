"""Specification: a lookup the client gave up on (its timeout passed while the server was stopped)
leaves nothing pinned once the server answers it late: the client releases the ticket its late reply
carries, so a hung-then-resumed server does not keep tickets for callers that moved on."""

from __future__ import annotations

import os
import signal

import pytest

from tests.server.conftest import StartServer, manifest
from tests.server.test_data_path import prompt_hashes, store_prompt
from tiercache.errors import ServerUnavailableError
from tiercache.testing.poll import stop_process, wait_until


def test_a_late_lookup_reply_releases_its_ticket(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as owner, server.client(timeout=0.3) as impatient:
        [group] = owner.register([(0, manifest())])
        hashes = prompt_hashes(3)
        store_prompt(owner, group, hashes)
        impatient.register([(0, manifest())])
        stop_process(server.process.pid)
        try:
            req = impatient.lookup_async(hashes, [group])
            with pytest.raises(ServerUnavailableError):
                wait_until(lambda: impatient.poll(req) is not None, timeout=10, what="a timeout")
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        # The server now answers the stale lookup (a hit: it pins the chunks under a ticket); the
        # impatient client's next call (or its heartbeat) reads that late reply and releases it.
        wait_until(lambda: owner.stats()["engine"]["lookups"] == 1, timeout=10, what="the late lookup")

        def released() -> bool:
            # Its own generous bound: a ping late by the impatient 0.3 s would reset the socket, and
            # the late reply (with the ticket to release) would go with it.
            impatient.ping(timeout=10)
            return owner.stats()["server"]["tickets"] == 0

        wait_until(released, timeout=10, what="the late ticket released")
        assert owner.lookup(hashes, [group], prefetch=False).chunks == 3  # nothing else changed
