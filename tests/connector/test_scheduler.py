"""The scheduler half (:mod:`tiercache.connector.scheduler`) without an engine: what it plans from
vLLM's scheduler calls over a fake link and lookup clients (:mod:`tests.connector.fakes`). Its
recurrent-state saves and loads, kv_role (a producer never loads, a consumer never stores), a
salted request's tenant, how it waits for lookups (``lookup_wait_s``, the pending ticket's
backoff, ``timeout_s`` and ``inflight_wait_s``) and its side of vLLM's asynchronous loads (the
ticket kept until the workers report). Tails are off here: ``test_scheduler_tails`` has them.

Needs vLLM (the metadata derives from vLLM's); skipped elsewhere."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector metadata derives from vLLM's")

from tests.connector.fakes import (
    HIT_BYTES,
    HIT_TICKET,
    LookupClient,
    Reply,
    hit_reply,
    prompt_request,
    scheduler_half,
    scheduler_output,
    step_output,
)
from tiercache.config.connector import ConnectorSettings
from tiercache.connector import scheduler_lookups
from tiercache.connector.metadata import TierCacheMetadata
from tiercache.connector.scheduler import SchedulerHalf
from tiercache.connector.scheduler_core import LookupState, _Probe, _Request
from tiercache.keys import ExtraKeys
from tiercache.keys.tenant import tenant_id
from tiercache.wire.protocol import LookupReply, TicketStateName

# -- recurrent state: the boundary-state blocks vLLM hands over ----------------------------------------


def test_saves_take_the_state_block_vllm_hands_over_for_each_chunk_end() -> None:
    """The recurrent group's block table is sparse and moves: the state after chunk c is read from
    the block of vLLM's boundary-state hand-off for (c + 1) * chunk tokens, never positionally;
    a chunk whose end had no state kept gets [0] (no state object)."""
    sched = scheduler_half()
    st = _Request("r", list(range(1700)), ExtraKeys(), state=LookupState.DONE, saved_upto=0)
    sched._reqs["r"] = st
    new = SimpleNamespace(
        req_id="r", block_ids=([11, 12, 13, 14, 15], [0, 0, 0, 0, 21]), num_computed_tokens=0
    )
    # vLLM kept the state at 768 (block 31) but not at 1536; 1152 is no chunk boundary; 2000 is past the prompt.
    offers = {"r": [(1, 31, 768), (1, 33, 1152), (1, 34, 2000), (0, 99, 768)]}
    meta = sched.build_connector_meta(scheduler_output([new], offers, {"r": 1700}))
    assert [(s.chunk_index, s.block_ids) for s in meta.saves] == [(0, [[11, 12], [31]]), (1, [[13, 14], [0]])]
    assert sched._saves_last_step  # state blocks are freed soon: flush next step


def test_a_hit_loads_the_state_into_the_block_at_the_boundary() -> None:
    """On a hit of 1536 tokens vLLM puts the state block at table position 1536 / 384 - 1 = 3; only
    the chunk ending at the boundary carries it (``state``)."""
    sched = scheduler_half()
    st = _Request("r", list(range(1700)), ExtraKeys(), state=LookupState.DONE, saved_upto=0)
    sched._reqs["r"] = st
    blocks = SimpleNamespace(get_block_ids=lambda: ([11, 12, 13, 14, 15], [0, 0, 0, 8, 9]))
    sched.update_state_after_alloc(SimpleNamespace(request_id="r"), blocks, 1536)
    meta = sched.build_connector_meta(scheduler_output([], {}, {}))
    (load,) = meta.loads
    assert [(c.positions, c.block_ids, c.state) for c in load.chunks] == [
        ([[0, 1], []], [[11, 12], []], False),
        ([[0, 1], [0]], [[13, 14], [8]], True),
    ]
    assert load.asynchronous and load.complete


# -- kv_role: a producer (prefill engine) never loads, a consumer (decode engine) never stores -------


def _scheduled(tokens: int = 2400) -> SimpleNamespace:
    new = SimpleNamespace(req_id="r", block_ids=(list(range(1, 8)),), num_computed_tokens=0)
    return scheduler_output([new], {}, {"r": tokens})


def test_a_producer_never_loads_and_stores_only_what_the_server_lacks() -> None:
    client = LookupClient(LookupReply(chunks=2, per_tier={"l1": 2}))
    sched = scheduler_half(client=client, recurrent=False, loads=False)
    assert sched.get_num_new_matched_tokens(prompt_request(), 0) == (0, False)
    assert client.asked == [(3, {"prefetch": False, "max_chunks": 3, "inflight_wait_s": 0.0, "tenant": b""})]
    meta = sched.build_connector_meta(_scheduled())
    assert [s.chunk_index for s in meta.saves] == [2]  # chunks 0 and 1 are on the server already
    assert sched.request_finished(prompt_request()) == (True, None)


def _hit_step(sched: SchedulerHalf, client: LookupClient) -> TierCacheMetadata:
    """Ask about request "r" (2400 tokens: 3 full chunks of 768) whose first 2 chunks the server
    holds, let vLLM allocate for the hit and build the step that computes the rest; its metadata."""
    assert sched.get_num_new_matched_tokens(prompt_request(), 0) == (2 * 768, False)
    blocks = SimpleNamespace(get_block_ids=lambda: (list(range(1, 8)),))
    sched.update_state_after_alloc(SimpleNamespace(request_id="r"), blocks, 2 * 768)
    new = SimpleNamespace(req_id="r", block_ids=(list(range(1, 8)),), num_computed_tokens=2 * 768)
    meta = sched.build_connector_meta(scheduler_output([new], {}, {"r": 2400 - 2 * 768}))
    (load,) = meta.loads
    assert [c.prefix_hash for c in load.chunks] == client.hashes[:2]
    return meta


def test_a_consumer_loads_waiting_for_stores_in_flight_and_never_stores() -> None:
    client = LookupClient(hit_reply(chunks=2))
    sched = scheduler_half(client=client, recurrent=False, stores=False)
    meta = _hit_step(sched, client)  # it loads the hit ...
    wait = ConnectorSettings().inflight_wait_s
    assert wait > 0
    assert client.asked == [(3, {"prefetch": True, "max_chunks": 3, "inflight_wait_s": wait, "tenant": b""})]
    assert not meta.saves  # ... and stores not even the chunk it computed
    assert sched.request_finished(prompt_request()) == (False, None)


def test_kv_both_loads_and_stores() -> None:
    client = LookupClient(hit_reply(chunks=2))
    sched = scheduler_half(client=client, recurrent=False)
    meta = _hit_step(sched, client)  # it loads the hit and stores the chunk it computes
    assert client.asked[0][1]["prefetch"] is True
    assert [s.chunk_index for s in meta.saves] == [2]


def test_a_salted_request_asks_and_stores_as_its_tenant_named_by_id_not_salt() -> None:
    client = LookupClient(LookupReply(chunks=0, per_tier={}))
    sched = scheduler_half(client=client, recurrent=False)
    sched.get_num_new_matched_tokens(prompt_request(cache_salt="acme-secret"), 0)
    tenant = tenant_id("acme-secret")
    assert client.asked[0][1]["tenant"] == tenant and b"acme" not in tenant
    saves = sched.build_connector_meta(_scheduled()).saves
    assert [s.tenant for s in saves] == [tenant] * 3


class _PendingClient(LookupClient):
    """Reports the lookup's ticket pending for ever: ``awaiting`` objects another engine is still
    storing (0: only promotions from a lower tier)."""

    def __init__(self, awaiting: int = 1) -> None:
        super().__init__(
            LookupReply(
                chunks=2, per_tier={"l1": 2}, state=TicketStateName.PENDING, ticket=7, awaiting=awaiting
            )
        )
        self.polls = 0

    def poll_ticket_async(self, ticket: int) -> int:
        self.polls += 1
        return 2


class _SteppedClock:
    """The scheduler's clock, moved by the test: a step of vLLM's engine loop every ``step_s``, so
    that what a test counts depends on the scheduler's rules, never on the machine's speed."""

    def __init__(self, step_s: float = 0.001) -> None:
        self.steps, self.step_s = 0, step_s

    def monotonic(self) -> float:
        return 1000.0 + self.steps * self.step_s  # from the step count: no accumulated rounding

    def tick(self) -> None:
        self.steps += 1

    def __getattr__(self, name: str) -> object:  # everything else is the real time module

        return getattr(time, name)


@pytest.fixture
def stepped(monkeypatch: pytest.MonkeyPatch) -> _SteppedClock:
    clock = _SteppedClock()
    monkeypatch.setattr(scheduler_lookups, "time", clock)  # its polls' clock
    return clock


def test_a_pending_ticket_is_polled_with_a_backoff_not_at_every_scheduler_step(
    stepped: _SteppedClock,
) -> None:
    client = _PendingClient()
    sched = scheduler_half(client=client, recurrent=False)
    for _ in range(300):  # vLLM asks about a waiting request at every step: one a millisecond here
        assert sched.get_num_new_matched_tokens(prompt_request(), 0) == (None, False)
        stepped.tick()
    # Polls after 1, 2, 4, 8 and 16 ms, then every 20 ms: at 1, 3, 7, 15, 31, 51, 71, ..., 291 ms.
    assert client.polls == 5 + 13


class _PromotingClient(LookupClient):
    """A server promoting the hit from S3: the lookup's reply is pending and counts the objects by
    tier; the ticket poll that follows is ready and, as the server's are, counts nothing."""

    def __init__(self) -> None:
        super().__init__(
            LookupReply(chunks=2, per_tier={"s3": 2}, state=TicketStateName.PENDING, ticket=HIT_TICKET)
        )
        self.ready = hit_reply(chunks=2)

    def poll_ticket_async(self, ticket: int) -> int:
        self.reply = lambda hashes: _no_tiers(self.ready(hashes))
        return 2


def _no_tiers(reply: LookupReply) -> LookupReply:
    reply.per_tier = {}
    return reply


def test_a_hit_promoted_from_s3_is_counted_by_the_tier_the_first_reply_named() -> None:
    client = _PromotingClient()
    sched = scheduler_half(client=client, recurrent=False)
    deadline = time.monotonic() + 5
    while (got := sched.get_num_new_matched_tokens(prompt_request(), 0)) == (None, False):
        assert time.monotonic() < deadline, "the promoted lookup never settled"
    assert got == (2 * 768, False)
    stats = sched.take_stats()
    assert stats is not None
    assert stats.data["hit_chunks"] == 2
    assert stats.data["hit_objects_by_tier"] == {"s3": 2}


def test_a_promoted_hit_answered_steps_later_is_timed_once_and_counted_as_deferred(
    stepped: _SteppedClock,
) -> None:
    """The wait an operator sees in ``vllm:tiercache_lookup_seconds``: from the lookup's send until
    the scheduler can answer vLLM, counted once however often vLLM asks afterwards, and the request
    counted as held back (``lookups_deferred``) because a step was built in between."""
    client = _PromotingClient()
    sched = scheduler_half(client=client, recurrent=False)
    assert sched.get_num_new_matched_tokens(prompt_request(), 0) == (None, False)  # promoting
    sched.build_connector_meta(scheduler_output([], {}, {}))  # vLLM runs a step without it
    for _ in range(5):
        stepped.tick()
    assert sched.get_num_new_matched_tokens(prompt_request(), 0) == (2 * 768, False)
    assert sched.get_num_new_matched_tokens(prompt_request(), 0) == (2 * 768, False)  # asked again
    stats = sched.take_stats()
    assert stats is not None
    assert stats.data["lookup_durations"] == [pytest.approx(0.005)]
    assert stats.data["lookups_deferred"] == 1


class _LateClient(LookupClient):
    """Its lookup replies come ``delay_s`` after the request (``None``: never); records how long
    each poll was allowed to wait."""

    def __init__(self, reply: Reply, delay_s: float | None) -> None:
        super().__init__(reply)
        self.delay_s, self.sent = delay_s, 0.0
        self.waits: list[float] = []

    def lookup_async(self, hashes: list[bytes], groups: object, **how: Any) -> int:
        self.sent = time.monotonic()
        return super().lookup_async(hashes, groups, **how)

    def poll(self, req_id: int, wait_s: float = 0.0) -> LookupReply | None:
        self.waits.append(wait_s)
        if self.delay_s is None:
            time.sleep(wait_s)
            return None
        left = self.sent + self.delay_s - time.monotonic()
        if left > wait_s:
            time.sleep(wait_s)
            return None
        time.sleep(max(left, 0.0))
        return super().poll(req_id)


def test_a_lookup_answered_within_lookup_wait_s_is_decided_in_the_same_step() -> None:
    """A hit answered within ``lookup_wait_s`` is a hit in this step: its tokens, the ticket that pins
    it and its slots; the load goes out with the step and the ticket is released once it ran."""
    client = _LateClient(hit_reply(chunks=2), delay_s=0.001)
    sched = scheduler_half(client=client, recurrent=False)
    # Not (None, False), "ask again next step": vLLM can schedule the request in this step.
    assert sched.get_num_new_matched_tokens(prompt_request(), 0) == (2 * 768, False)
    assert client.waits == [ConnectorSettings().lookup_wait_s] and client.waits[0] > 0
    timed = sched.take_stats()
    assert timed is not None and timed.data["lookups_deferred"] == 0  # not held back a step
    assert len(timed.data["lookup_durations"]) == 1 and timed.data["lookup_durations"][0] >= 0.001
    st = sched._reqs["r"]
    assert st.probe.ticket == HIT_TICKET
    assert st.slots == {0: {0: (0, HIT_BYTES, 0)}, 1: {0: (HIT_BYTES, HIT_BYTES, 0)}}
    blocks = SimpleNamespace(get_block_ids=lambda: (list(range(1, 8)),))
    sched.update_state_after_alloc(SimpleNamespace(request_id="r"), blocks, 2 * 768)
    (load,) = sched.build_connector_meta(scheduler_output([], {}, {})).loads
    assert [c.prefix_hash for c in load.chunks] == client.hashes[:2]
    assert [c.block_ids for c in load.chunks] == [[[1, 2]], [[3, 4]]]
    assert client.released == []  # never while a worker may copy from the slots
    sched.update_connector_output(SimpleNamespace(finished_recving=None, failed_recving=set()))
    assert client.released == [HIT_TICKET]


def test_with_lookup_wait_s_0_every_reply_is_collected_at_the_next_step() -> None:
    client = _LateClient(hit_reply(), delay_s=0.001)
    sched = scheduler_half(client=client, recurrent=False, settings=ConnectorSettings(lookup_wait_s=0))
    assert sched.get_num_new_matched_tokens(prompt_request(), 0) == (None, False)
    assert client.waits == [0.0]


def test_a_silent_server_costs_one_step_at_most_lookup_wait_s_however_many_requests_arrive() -> None:
    client = _LateClient(hit_reply(), delay_s=None)
    settings = ConnectorSettings(lookup_wait_s=0.02)
    sched = scheduler_half(client=client, recurrent=False, settings=settings)
    for i in range(10):
        request = prompt_request(request_id=f"r{i}")
        assert sched.get_num_new_matched_tokens(request, 0) == (None, False)
    assert client.waits[0] == 0.02 and sum(client.waits) <= 0.02 + 1e-9  # the step's budget, shared
    sched.build_connector_meta(_scheduled())  # the next step
    client.waits.clear()
    sched.get_num_new_matched_tokens(prompt_request(request_id="late"), 0)
    assert client.waits == [0.02]  # a new step, a new budget


class _LatePromotionClient(_LateClient):
    """Promoting the hit: the lookup's reply (pending) comes ``lookup_delay_s`` after the lookup,
    and the ready reply to the ticket poll that follows ``delay_s`` after the poll."""

    def __init__(self, delay_s: float, lookup_delay_s: float = 0.0) -> None:
        super().__init__(
            LookupReply(chunks=2, per_tier={"disk": 2}, state=TicketStateName.PENDING, ticket=HIT_TICKET),
            delay_s=lookup_delay_s,
        )
        self.poll_delay_s = delay_s

    def poll_ticket_async(self, ticket: int) -> int:
        self.sent, self.delay_s, self.reply = time.monotonic(), self.poll_delay_s, hit_reply(chunks=2)
        return 2


def test_a_ticket_poll_is_waited_for_like_a_lookup_so_a_promotion_costs_one_step_not_two() -> None:
    """The server answers a ticket poll at once; read only at the next step, every promotion would
    hold its request back a step more than the promotion itself does."""
    client = _LatePromotionClient(delay_s=0.001)
    sched = scheduler_half(client=client, recurrent=False)
    assert sched.get_num_new_matched_tokens(prompt_request(), 0) == (None, False)  # promoting
    sched.build_connector_meta(scheduler_output([], {}, {}))  # vLLM runs a step without it
    time.sleep(0.002)  # the promotion is done; the first poll is due (1 ms)
    client.waits.clear()
    assert sched.get_num_new_matched_tokens(prompt_request(), 0) == (2 * 768, False)
    assert client.waits == [ConnectorSettings().lookup_wait_s]
    assert sched._reqs["r"].probe.ticket == HIT_TICKET


def test_a_pending_reply_read_a_step_late_is_followed_by_a_poll_at_once() -> None:
    """A lookup's pending reply that came after the step's ``lookup_wait_s`` is read at the next
    step, when the backoff (counted from the lookup's send) has passed already: the ticket is polled
    then and there, and the request is answered in that step, not a step later still."""
    client = _LatePromotionClient(delay_s=0.001, lookup_delay_s=0.010)
    sched = scheduler_half(client=client, recurrent=False)
    assert sched.get_num_new_matched_tokens(prompt_request(), 0) == (None, False)  # no reply in 5 ms
    sched.build_connector_meta(scheduler_output([], {}, {}))  # vLLM runs a step without it
    time.sleep(0.015)  # the pending reply came meanwhile, and so did the promotion
    assert sched.get_num_new_matched_tokens(prompt_request(), 0) == (2 * 768, False)
    timed = sched.take_stats()
    assert timed is not None and timed.data["lookups_deferred"] == 1


def _settled_after(
    sched: SchedulerHalf, clock: _SteppedClock, steps: int
) -> tuple[float, tuple[int | None, bool] | None]:
    """Ask about the request at every step (1 ms apart) until the lookup settles or ``steps`` ran:
    (the scheduler's seconds since the first ask, the answer or ``None``)."""
    began = clock.monotonic()
    for _ in range(steps):
        answer = sched.get_num_new_matched_tokens(prompt_request(), 0)
        if answer != (None, False):
            return clock.monotonic() - began, answer
        clock.tick()
    return clock.monotonic() - began, None


def test_a_slow_promotion_is_given_up_after_timeout_s_not_the_in_flight_wait_too(
    stepped: _SteppedClock,
) -> None:
    client = _PendingClient(awaiting=0)  # the server is promoting from disk or S3
    settings = ConnectorSettings(timeout_s=0.2, inflight_wait_s=30.0, tails=False)
    sched = scheduler_half(client=client, recurrent=False, settings=settings)
    took, answer = _settled_after(sched, stepped, 10_000)
    assert answer == (0, False), "a promotion slower than timeout_s is computed instead"
    # Given up at the first poll past timeout_s (polls are at most 20 ms apart), not 30 s later.
    assert 0.2 < took <= 0.2 + 0.021


def test_a_wait_for_another_engines_store_gets_inflight_wait_s_on_top_of_timeout_s(
    stepped: _SteppedClock,
) -> None:
    client = _PendingClient(awaiting=2)  # a prefill engine's stores are still in flight
    settings = ConnectorSettings(timeout_s=0.2, inflight_wait_s=1.0, tails=False)
    sched = scheduler_half(client=client, recurrent=False, settings=settings)
    took, answer = _settled_after(sched, stepped, 10_000)
    assert answer == (0, False)
    assert 1.2 < took <= 1.2 + 0.021, f"gave up after {took:.3f} s, not at timeout_s + inflight_wait_s"


# -- asynchronous loads: the scheduler half's side of vLLM's WAITING_FOR_REMOTE_KVS protocol ---------


class _TicketClient:
    """Records the tickets the scheduler half releases."""

    def __init__(self) -> None:
        self.released: list[int] = []
        self.flushed = 0  # how many of the releases a flush_releases had sent
        self.read: list[bool] = []

    def release_ticket_later(self, ticket: int, *, read: bool = False) -> None:
        self.released.append(ticket)
        self.read.append(read)

    def flush_releases(self) -> None:
        self.flushed = len(self.released)  # every release held back so far went out


def _hit_scheduler(asynchronous: bool) -> tuple[SchedulerHalf, _Request, _TicketClient]:
    """A scheduler half (two KV-cache groups when ``asynchronous``, else as for a dense model) whose
    lookup for request "r" (1700 tokens) settled on a 2-chunk hit pinned by ticket 5."""
    client = _TicketClient()
    # Two KV-cache groups make vLLM's loads asynchronous; one full-attention group keeps them in step.
    sched = scheduler_half(client=client, recurrent=asynchronous)
    st = _Request(
        "r",
        list(range(1700)),
        ExtraKeys(),
        state=LookupState.DONE,
        saved_upto=0,
        hit_chunks=2,
        probe=_Probe(ticket=5),
    )
    sched._reqs["r"] = st
    return sched, st, client


def _alloc(sched: SchedulerHalf, tokens: int = 1536) -> None:
    blocks = SimpleNamespace(get_block_ids=lambda: ([11, 12, 13, 14, 15], [0, 0, 0, 8, 9]))
    sched.update_state_after_alloc(SimpleNamespace(request_id="r"), blocks, tokens)


@pytest.mark.parametrize("asynchronous", [True, False])
def test_several_kv_cache_groups_make_the_hit_asynchronous(asynchronous: bool) -> None:
    sched, _, _ = _hit_scheduler(asynchronous)
    request = SimpleNamespace(request_id="r", prompt_token_ids=list(range(1700)))
    assert sched.get_num_new_matched_tokens(request, 0) == (1536, asynchronous)


def test_the_ticket_is_kept_until_the_workers_report_the_load() -> None:
    sched, st, client = _hit_scheduler(True)
    _alloc(sched)
    assert sched.build_connector_meta(scheduler_output([], {}, {})).loads[0].req_id == "r"
    sched.update_connector_output(step_output())  # parked: nothing reported yet
    sched.build_connector_meta(scheduler_output([], {}, {}))
    sched.update_connector_output(step_output())
    assert client.released == [] and st.probe.ticket == 5 and st.loading
    sched.build_connector_meta(scheduler_output([], {}, {}))
    sched.update_connector_output(step_output({"r"}))
    assert client.released == [5] and not st.loading and not st.load_failed


def test_a_release_rides_the_next_lookup_and_the_next_step_sends_what_none_took() -> None:
    """Released after the step that reported the load, the ticket is held back by the client for
    its next lookup (a message fewer for the server); the next step's metadata, built after that
    step's lookups went out, sends whatever no lookup took along."""
    sched, _, client = _hit_scheduler(True)
    _alloc(sched)
    sched.build_connector_meta(scheduler_output([], {}, {}))
    sched.update_connector_output(step_output({"r"}))
    assert client.released == [5] and client.flushed == 0  # held back
    sched.build_connector_meta(scheduler_output([], {}, {}))
    assert client.flushed == 1  # no lookup took it: sent with the next step
    sched.update_connector_output(step_output())
    client.flushed = -1
    sched.build_connector_meta(scheduler_output([], {}, {}))
    assert client.flushed == -1  # nothing held back: no flush


@pytest.mark.parametrize("failed", [False, True], ids=["loaded", "failed"])
def test_an_asynchronous_load_from_the_tickets_slots_releases_it_as_read_unless_it_failed(
    failed: bool,
) -> None:
    """The workers pinned nothing: the ticket's release is what tells the server its objects were
    read (L1 hits, eviction order); a failed load read nothing it could use."""
    sched, st, client = _hit_scheduler(True)
    st.probe.sent_at, st.probe.arena = time.monotonic(), "tiercache-arena"
    st.slots = {
        c: {0: (2 * c * HIT_BYTES, HIT_BYTES, 0), 1: ((2 * c + 1) * HIT_BYTES, HIT_BYTES, 0)}
        for c in (0, 1, 2)
    }
    _alloc(sched)
    (load,) = sched.build_connector_meta(scheduler_output([], {}, {})).loads
    assert load.asynchronous and load.arena == "tiercache-arena" and load.leased_at == st.probe.sent_at
    sched.update_connector_output(step_output({"r"}, {"r"} if failed else set()))
    assert client.released == [5] and client.read == [not failed]


def test_a_synchronous_hit_releases_the_ticket_once_its_step_ran() -> None:
    sched, _, client = _hit_scheduler(False)
    _alloc(sched)
    assert not sched.build_connector_meta(scheduler_output([], {}, {})).loads[0].asynchronous
    sched.update_connector_output(step_output())
    assert client.released == [5]


def test_after_a_failed_load_the_retry_computes() -> None:
    """vLLM frees a failed request's blocks and schedules it again from token 0 (asking for a match
    again): the cache offers nothing, so the retry never waits on the same failure twice."""
    sched, _, client = _hit_scheduler(True)
    _alloc(sched)
    sched.build_connector_meta(scheduler_output([], {}, {}))
    sched.update_connector_output(step_output({"r"}, {"r"}))
    assert client.released == [5]
    request = SimpleNamespace(request_id="r", prompt_token_ids=list(range(1700)))
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)


def test_a_request_finished_while_loading_releases_its_ticket_once_after_the_load_step() -> None:
    sched, _, client = _hit_scheduler(True)
    _alloc(sched)
    sched.build_connector_meta(scheduler_output([], {}, {}))  # step 1 carries the load
    assert sched.request_finished(SimpleNamespace(request_id="r")) == (False, None)
    sched.update_connector_output(step_output({"r"}))  # step 1 ran
    assert client.released == []  # released after the next step: never while a worker may copy
    sched.build_connector_meta(scheduler_output([], {}, {}))
    sched.update_connector_output(step_output())
    assert client.released == [5] and sched._reqs == {}


def test_a_preempted_request_loading_anew_is_not_held_for_its_earlier_stores() -> None:
    """Its earlier stores were flushed at the preemption. Finished while loading, vLLM frees it on
    finished_recving; holding it for finished_sending as well would report a freed request."""
    sched, st, _ = _hit_scheduler(True)
    st.saves_scheduled = 2  # stores of the run before the preemption
    _alloc(sched)
    assert sched.request_finished(SimpleNamespace(request_id="r")) == (False, None)


def test_a_load_whose_blocks_are_missing_is_sent_incomplete() -> None:
    """vLLM counts every external token as computed once the load is reported: a chunk the
    scheduler cannot place makes the workers report the whole load failed."""
    sched, _, _ = _hit_scheduler(True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([11, 12, 13], [0, 0, 0]))
    sched.update_state_after_alloc(SimpleNamespace(request_id="r"), blocks, 1536)
    (load,) = sched.build_connector_meta(scheduler_output([], {}, {})).loads
    assert load.asynchronous and not load.complete
