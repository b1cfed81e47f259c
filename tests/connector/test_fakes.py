"""Specification: every fake of the client the connector's tests use takes every call the real
client takes under the names it fakes (:mod:`tiercache.testing.client_conformance`), so the code
under test cannot call the real client in a way its tests never saw."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.connector import (
    test_kv_events,
    test_scheduler,
    test_scheduler_tails,
    test_worker,
    test_worker_pages,
)
from tests.connector.fakes import LookupClient
from tiercache.testing.client_conformance import assert_conforms

FAKES = [
    LookupClient,
    test_scheduler._PendingClient,
    test_scheduler._PromotingClient,
    test_scheduler._LateClient,
    test_scheduler._TicketClient,
    test_scheduler_tails._SequencedClient,
    test_worker._PinClient,
    test_worker_pages.FakeClient,
    test_worker_pages.GatedClient,
    test_kv_events.ScriptedLog,
]


@pytest.mark.parametrize("fake", FAKES, ids=lambda fake: fake.__name__)
def test_the_fake_takes_every_call_the_client_takes(fake: type) -> None:
    assert_conforms(fake)
