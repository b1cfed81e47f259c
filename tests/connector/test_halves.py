"""The connector's pieces and its two halves, without an engine: settings, weights identity, block
sizes, layouts, the scheduler half's planning and the worker half's loads (fake links and clients).

Tests that need vLLM (for its metadata base class) skip without it; CI runs them in its vLLM
environment. ``tests/e2e`` runs the real engine.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest

from tests.connector.fakes import link_to
from tiercache.config.connector import ConnectorSettings
from tiercache.connector.layout import check_block_sizes
from tiercache.errors import ConfigError
from tiercache.keys.weights import content_fingerprint, weights_identity
from tiercache.testing.poll import wait_until
from tiercache.wire.protocol import LookupKind, LookupReply

ROOT = Path(__file__).resolve().parents[2]


def test_settings_defaults_and_prefixed_keys() -> None:
    s = ConnectorSettings.from_extra_config({})
    assert (s.server, s.timeout_s, s.retry_s, s.lookup_wait_s) == (None, 2.0, 5.0, 0.005)
    s = ConnectorSettings.from_extra_config(
        {"tiercache.server": "ipc:///x.sock", "timeout_s": "0.5", "other": 1}
    )
    assert (s.server, s.timeout_s) == ("ipc:///x.sock", 0.5)


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"server": "localhost:5600"}, "ipc://"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"tiercache.chunk_size": 256}, "unknown"),
        ({"overlap_loads": "sometimes"}, "overlap_loads"),
        ({"lookup_wait_s": -0.001}, "lookup_wait_s"),
        ({"lookup_wait_s": 3, "timeout_s": 2}, "lookup_wait_s=3.0 must be 0 to timeout_s"),
    ],
)
def test_settings_errors_name_the_key(extra: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        ConnectorSettings.from_extra_config(extra)


@pytest.mark.parametrize(
    ("value", "expected"), [(None, False), (True, True), ("false", False), ("On", True), (0, False)]
)
def test_overlap_loads_is_off_unless_set(value: object, expected: bool) -> None:
    extra = {} if value is None else {"overlap_loads": value}
    assert ConnectorSettings.from_extra_config(extra).overlap_loads is expected


def test_only_explicitly_overlapped_loads_ask_vllm_for_piecewise_cuda_graphs() -> None:
    """Per-layer waits cannot run inside a FULL CUDA graph; the default (no overlap) keeps vLLM's
    CUDA graph mode."""
    pytest.importorskip("vllm")
    from tiercache.connector import TierCacheConnector

    assert TierCacheConnector.requires_piecewise_for_cudagraph({"overlap_loads": True}) is True
    assert TierCacheConnector.requires_piecewise_for_cudagraph({}) is False
    assert TierCacheConnector.requires_piecewise_for_cudagraph({"overlap_loads": False}) is False


def test_auth_secret_is_never_printed() -> None:
    s = ConnectorSettings.from_extra_config({"auth_secret": "hunter2"})
    assert s.auth_secret == "hunter2" and "hunter2" not in repr(s)


def test_the_secret_comes_from_a_file_and_an_inline_one_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM prints kv_connector_extra_config at start-up (its "non-default args" line) and it is on
    the engine's command line: a secret belongs in a file the config names."""
    secret = tmp_path / "secret"
    secret.write_text("s3cr3t-from-a-file\n")
    s = ConnectorSettings.from_extra_config({"auth_secret_file": str(secret)})
    assert s.auth_secret == "s3cr3t-from-a-file"
    assert not caplog.records
    ConnectorSettings.from_extra_config({"auth_secret": "hunter2"})
    assert any(
        "auth_secret_file" in r.getMessage() and "hunter2" not in r.getMessage() for r in caplog.records
    )
    with pytest.raises(ConfigError, match=r"auth_secret_file=.* cannot be read"):
        ConnectorSettings.from_extra_config({"auth_secret_file": str(tmp_path / "missing")})


def test_chunk_size_error_states_both_sizes_and_the_fix() -> None:
    check_block_sizes(128, 32, [32])
    with pytest.raises(ConfigError) as err:
        check_block_sizes(48, 32, [32])
    msg = str(err.value)
    assert "--chunk-size 48" in msg and "block size 32" in msg and "--chunk-size 32 or a multiple" in msg


def _checkpoint(d: Path, payload: bytes) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(payload)
    return d


def test_weights_identity_follows_the_weights_not_the_path(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "m", b"A" * 3_000_000)
    first = weights_identity(str(model))
    assert first.startswith("files:") and weights_identity(str(model)) == first
    (model / "model.safetensors").write_bytes(b"B" * 3_000_000)  # other weights, same path and size
    assert weights_identity(str(model)) != first
    assert weights_identity(str(model), override="my-build-7") == "id:my-build-7"


def test_weights_identity_without_files_uses_the_revision(tmp_path: Path) -> None:
    assert content_fingerprint(tmp_path) is None
    assert weights_identity("org/not-a-cached-model-xyz", revision="abc123") == "rev:abc123"


# -- KV-cache group kinds (fake spec objects: only the class names and fields matter) -----------------


def _fake_spec(cls_name: str, block_size: int = 32, **fields: object) -> object:
    return type(cls_name, (), {"block_size": block_size, **fields})()


def test_full_sliding_and_recurrent_groups_are_accepted() -> None:
    from tiercache.connector.layout import check_group_specs

    check_group_specs([_fake_spec("SlidingWindowSpec", sliding_window=64), _fake_spec("FullAttentionSpec")])
    check_group_specs([_fake_spec("MambaSpec", num_speculative_blocks=0), _fake_spec("FullAttentionSpec")])


@pytest.mark.parametrize(
    "spec, words",
    [
        (_fake_spec("MambaSpec", num_speculative_blocks=2), "speculative"),
        (_fake_spec("ChunkedLocalAttentionSpec", attention_chunk_size=64), "not supported"),
        (_fake_spec("SlidingWindowSpec", sliding_window=64, extra_retained_tokens=3), "extra retained"),
    ],
)
def test_unsupported_groups_fail_with_a_clear_error(spec: object, words: str) -> None:
    from tiercache.connector.layout import check_group_specs

    with pytest.raises(ConfigError, match=words):
        check_group_specs([_fake_spec("FullAttentionSpec"), spec])


def test_sliding_group_needs_only_its_trailing_window_chunks() -> None:
    from tiercache.connector.layout import GroupLayout

    def group(window: int) -> GroupLayout:
        return GroupLayout(0, 0, 0, ("l0",), 32, 2, 8192, None, window_tokens=window)  # type: ignore[arg-type]

    assert list(group(0).needed_chunks(3, 64)) == [0, 1, 2]
    assert list(group(64).needed_chunks(3, 64)) == [2]
    assert list(group(65).needed_chunks(3, 64)) == [1, 2]  # ceil(65 / 64) = 2 chunks
    assert list(group(4096).needed_chunks(3, 64)) == [0, 1, 2]


def test_recurrent_group_needs_only_the_state_at_the_boundary() -> None:
    from tiercache.connector.layout import GroupLayout

    state = GroupLayout(1, 1, 0, ("l0",), 384, 1, 134144, None, recurrent=True)  # type: ignore[arg-type]
    assert list(state.needed_chunks(3, 384)) == [2]  # the state after chunk 2 = the state at 3 chunks
    assert list(state.needed_chunks(0, 384)) == []
    assert state.object_bytes == 134144  # one state page per layer, whatever the chunk size


# -- the scheduler half's recurrent-state planning (needs vLLM only for the metadata base class) -----


def _recurrent_scheduler(
    chunk: int = 768,
    block: int = 384,
    client: object = None,
    recurrent: bool = True,
    *,
    loads: bool = True,
    stores: bool = True,
    settings: ConnectorSettings | None = None,
) -> object:
    """A SchedulerHalf with kv group 0 full attention and (``recurrent``) kv group 1 recurrent
    state, whose link is up with ``client`` (its planning methods only need a layout and a link);
    ``loads`` / ``stores`` as vLLM's kv_role sets them."""
    pytest.importorskip("vllm")
    from tiercache.connector.layout import EngineLayout, GroupLayout
    from tiercache.connector.scheduler import SchedulerHalf

    sched = SchedulerHalf(
        None,
        None,
        # Whole chunks unless a test asks for tails (the connector's default is on: see below).
        settings or ConnectorSettings(tails=False),
        link=link_to(client if client is not None else object()),
        loads=loads,
        stores=stores,
    )
    groups = [GroupLayout(0, 0, 0, ("attn",), block, chunk // block, 196608, None)]  # type: ignore[arg-type]
    if recurrent:
        groups.append(GroupLayout(1, 1, 0, ("gdn",), block, 1, 134144, None, recurrent=True))  # type: ignore[arg-type]
    sched.use_layout(
        EngineLayout(tuple(groups), world_size=1, scheduler_block_size=block, chunk_size=chunk), []
    )
    return sched


def _output(
    new: list[object], offers: dict[str, list[tuple[int, int, int]]], scheduled: dict[str, int]
) -> object:
    from types import SimpleNamespace

    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
        ),
        num_scheduled_tokens=scheduled,
        preempted_req_ids=set(),
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads=offers),
        new_block_ids_to_zero=[7, 8, 9],
    )


def test_saves_take_the_state_block_vllm_hands_over_for_each_chunk_end() -> None:
    """The recurrent group's block table is sparse and moves: the state after chunk c is read from
    the block of vLLM's boundary-state hand-off for (c + 1) * chunk tokens, never positionally;
    a chunk whose end had no state kept gets [0] (no state object)."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from tiercache.connector.scheduler import LookupState, _Request
    from tiercache.keys import ExtraKeys

    sched = _recurrent_scheduler()
    st = _Request("r", list(range(1700)), ExtraKeys(), state=LookupState.DONE, saved_upto=0)
    sched._reqs["r"] = st  # type: ignore[attr-defined]
    new = SimpleNamespace(
        req_id="r", block_ids=([11, 12, 13, 14, 15], [0, 0, 0, 0, 21]), num_computed_tokens=0
    )
    # vLLM kept the state at 768 (block 31) but not at 1536; 1152 is no chunk boundary; 2000 is past the prompt.
    offers = {"r": [(1, 31, 768), (1, 33, 1152), (1, 34, 2000), (0, 99, 768)]}
    meta = sched.build_connector_meta(_output([new], offers, {"r": 1700}))  # type: ignore[attr-defined]
    assert [(s.chunk_index, s.block_ids) for s in meta.saves] == [(0, [[11, 12], [31]]), (1, [[13, 14], [0]])]
    assert sched._saves_last_step  # type: ignore[attr-defined]  # state blocks are freed soon: flush next step


def test_a_hit_loads_the_state_into_the_block_at_the_boundary() -> None:
    """On a hit of 1536 tokens vLLM puts the state block at table position 1536 / 384 - 1 = 3; only
    the chunk ending at the boundary carries it (``state``)."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from tiercache.connector.scheduler import LookupState, _Request
    from tiercache.keys import ExtraKeys

    sched = _recurrent_scheduler()
    st = _Request("r", list(range(1700)), ExtraKeys(), state=LookupState.DONE, saved_upto=0)
    sched._reqs["r"] = st  # type: ignore[attr-defined]
    blocks = SimpleNamespace(get_block_ids=lambda: ([11, 12, 13, 14, 15], [0, 0, 0, 8, 9]))
    sched.update_state_after_alloc(SimpleNamespace(request_id="r"), blocks, 1536)  # type: ignore[attr-defined]
    meta = sched.build_connector_meta(_output([], {}, {}))  # type: ignore[attr-defined]
    (load,) = meta.loads
    assert [(c.positions, c.block_ids, c.state) for c in load.chunks] == [
        ([[0, 1], []], [[11, 12], []], False),
        ([[0, 1], [0]], [[13, 14], [8]], True),
    ]
    assert load.asynchronous and load.complete


# -- kv_role: a producer (prefill engine) never loads, a consumer (decode engine) never stores -------


class _LookupClient:
    """Answers every lookup with ``reply`` (or, if it is callable, with ``reply(hashes asked)``),
    records how each was asked and the tickets released."""

    def __init__(self, reply: object) -> None:
        self.reply, self.asked, self.released = reply, [], []  # type: ignore[var-annotated]
        self.read: list[bool] = []  # per released ticket: whether a load copied from its slots
        self.hashes: list[bytes] = []
        self.tail = False  # whether the last lookup asked for a tail

    def lookup_async(self, hashes: list[bytes], refs: object, **how: object) -> int:
        self.asked.append((len(hashes), how))
        self.hashes = list(hashes)
        self.tail = how.get("kind") is LookupKind.TAIL
        return 1

    def poll(self, req_id: int, wait_s: float = 0.0) -> object:
        reply = self.reply(self.hashes) if callable(self.reply) else self.reply
        if self.tail and isinstance(reply, LookupReply):  # a tail's answer counts its blocks
            return msgspec.structs.replace(reply, blocks=reply.chunks, chunks=min(reply.chunks, 1))
        return reply

    def release_ticket(self, ticket: int, *, read: bool = False) -> None:
        self.released.append(ticket)
        self.read.append(read)


HIT_TICKET, HIT_BYTES = 9, 196608  # the ticket pinning the hit; one chunk's object (_recurrent_scheduler)


def _hit_reply(chunks: int = 2, arena: str = "tiercache-arena") -> object:
    """What a server answers a prefetching lookup whose first ``chunks`` chunks it holds in L1: READY,
    pinned under ticket ``HIT_TICKET``, one slot per chunk (object group 0) of the hashes asked, in
    the L1 arena ``arena``."""
    from tiercache.keys import ObjectKey
    from tiercache.keys.fingerprint import Fingerprint
    from tiercache.wire.protocol import LookupReply, Slot, TicketStateName

    def reply(hashes: list[bytes]) -> object:
        fp = Fingerprint(bytes(16))
        slots = [
            Slot(ObjectKey(fp, 0, h).to_bytes(), offset=i * HIT_BYTES, nbytes=HIT_BYTES, token=100 + i)
            for i, h in enumerate(hashes[:chunks])
        ]
        return LookupReply(
            chunks=chunks,
            per_tier={"l1": chunks},
            state=TicketStateName.READY,
            ticket=HIT_TICKET,
            ready_chunks=chunks,
            slots=slots,
            arena=arena,
        )

    return reply


def _prompt_request(tokens: int = 2400, cache_salt: str | None = None, request_id: str = "r") -> object:
    from types import SimpleNamespace

    return SimpleNamespace(
        request_id=request_id, prompt_token_ids=list(range(tokens)), lora_request=None, cache_salt=cache_salt
    )


def _scheduled(tokens: int = 2400) -> object:
    from types import SimpleNamespace

    new = SimpleNamespace(req_id="r", block_ids=(list(range(1, 8)),), num_computed_tokens=0)
    return _output([new], {}, {"r": tokens})


def test_a_producer_never_loads_and_stores_only_what_the_server_lacks() -> None:
    pytest.importorskip("vllm")
    from tiercache.wire.protocol import LookupReply

    client = _LookupClient(LookupReply(chunks=2, per_tier={"l1": 2}))
    sched = _recurrent_scheduler(client=client, recurrent=False, loads=False)
    assert sched.get_num_new_matched_tokens(_prompt_request(), 0) == (0, False)  # type: ignore[attr-defined]
    assert client.asked == [(3, {"prefetch": False, "max_chunks": 3, "inflight_wait_s": 0.0, "tenant": b""})]
    meta = sched.build_connector_meta(_scheduled())  # type: ignore[attr-defined]
    assert [s.chunk_index for s in meta.saves] == [2]  # chunks 0 and 1 are on the server already
    assert sched.request_finished(_prompt_request()) == (True, None)  # type: ignore[attr-defined]


def _hit_step(sched: object, client: _LookupClient) -> object:
    """Ask about request "r" (2400 tokens: 3 full chunks of 768) whose first 2 chunks the server
    holds, let vLLM allocate for the hit and build the step that computes the rest; its metadata."""
    from types import SimpleNamespace

    assert sched.get_num_new_matched_tokens(_prompt_request(), 0) == (2 * 768, False)  # type: ignore[attr-defined]
    blocks = SimpleNamespace(get_block_ids=lambda: (list(range(1, 8)),))
    sched.update_state_after_alloc(SimpleNamespace(request_id="r"), blocks, 2 * 768)  # type: ignore[attr-defined]
    new = SimpleNamespace(req_id="r", block_ids=(list(range(1, 8)),), num_computed_tokens=2 * 768)
    meta = sched.build_connector_meta(_output([new], {}, {"r": 2400 - 2 * 768}))  # type: ignore[attr-defined]
    (load,) = meta.loads
    assert [c.prefix_hash for c in load.chunks] == client.hashes[:2]
    return meta


def test_a_consumer_loads_waiting_for_stores_in_flight_and_never_stores() -> None:
    pytest.importorskip("vllm")
    client = _LookupClient(_hit_reply(chunks=2))
    sched = _recurrent_scheduler(client=client, recurrent=False, stores=False)
    meta = _hit_step(sched, client)  # it loads the hit ...
    wait = ConnectorSettings().inflight_wait_s
    assert wait > 0
    assert client.asked == [(3, {"prefetch": True, "max_chunks": 3, "inflight_wait_s": wait, "tenant": b""})]
    assert not meta.saves  # type: ignore[attr-defined]  # ... and stores not even the chunk it computed
    assert sched.request_finished(_prompt_request()) == (False, None)  # type: ignore[attr-defined]


def test_kv_both_loads_and_stores() -> None:
    pytest.importorskip("vllm")
    client = _LookupClient(_hit_reply(chunks=2))
    sched = _recurrent_scheduler(client=client, recurrent=False)
    meta = _hit_step(sched, client)  # it loads the hit and stores the chunk it computes
    assert client.asked[0][1]["prefetch"] is True
    assert [s.chunk_index for s in meta.saves] == [2]  # type: ignore[attr-defined]


def test_a_salted_request_asks_and_stores_as_its_tenant_named_by_id_not_salt() -> None:
    pytest.importorskip("vllm")
    from tiercache.keys.tenant import tenant_id
    from tiercache.wire.protocol import LookupReply

    client = _LookupClient(LookupReply(chunks=0, per_tier={}))
    sched = _recurrent_scheduler(client=client, recurrent=False)
    sched.get_num_new_matched_tokens(_prompt_request(cache_salt="acme-secret"), 0)  # type: ignore[attr-defined]
    tenant = tenant_id("acme-secret")
    assert client.asked[0][1]["tenant"] == tenant and b"acme" not in tenant
    saves = sched.build_connector_meta(_scheduled()).saves  # type: ignore[attr-defined]
    assert [s.tenant for s in saves] == [tenant] * 3


class _PendingClient(_LookupClient):
    """Reports the lookup's ticket pending for ever: ``awaiting`` objects another engine is still
    storing (0: only promotions from a lower tier)."""

    def __init__(self, awaiting: int = 1) -> None:
        from tiercache.wire.protocol import LookupReply, TicketStateName

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
        import time

        return getattr(time, name)


@pytest.fixture
def stepped(monkeypatch: pytest.MonkeyPatch) -> _SteppedClock:
    pytest.importorskip("vllm")
    from tiercache.connector import scheduler

    clock = _SteppedClock()
    monkeypatch.setattr(scheduler, "time", clock)
    return clock


def test_a_pending_ticket_is_polled_with_a_backoff_not_at_every_scheduler_step(
    stepped: _SteppedClock,
) -> None:
    client = _PendingClient()
    sched = _recurrent_scheduler(client=client, recurrent=False)
    for _ in range(300):  # vLLM asks about a waiting request at every step: one a millisecond here
        assert sched.get_num_new_matched_tokens(_prompt_request(), 0) == (None, False)  # type: ignore[attr-defined]
        stepped.tick()
    # Polls after 1, 2, 4, 8 and 16 ms, then every 20 ms: at 1, 3, 7, 15, 31, 51, 71, ..., 291 ms.
    assert client.polls == 5 + 13


class _PromotingClient(_LookupClient):
    """A server promoting the hit from S3: the lookup's reply is pending and counts the objects by
    tier; the ticket poll that follows is ready and, as the server's are, counts nothing."""

    def __init__(self) -> None:
        from tiercache.wire.protocol import LookupReply, TicketStateName

        super().__init__(
            LookupReply(chunks=2, per_tier={"s3": 2}, state=TicketStateName.PENDING, ticket=HIT_TICKET)
        )
        self.ready = _hit_reply(chunks=2)

    def poll_ticket_async(self, ticket: int) -> int:
        self.reply = lambda hashes: _no_tiers(self.ready(hashes))
        return 2


def _no_tiers(reply: object) -> object:
    reply.per_tier = {}  # type: ignore[attr-defined]
    return reply


def test_a_hit_promoted_from_s3_is_counted_by_the_tier_the_first_reply_named() -> None:
    import time

    pytest.importorskip("vllm")
    client = _PromotingClient()
    sched = _recurrent_scheduler(client=client, recurrent=False)
    deadline = time.monotonic() + 5
    while (got := sched.get_num_new_matched_tokens(_prompt_request(), 0)) == (None, False):  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the promoted lookup never settled"
    assert got == (2 * 768, False)
    stats = sched.take_stats()  # type: ignore[attr-defined]
    assert stats.data["hit_chunks"] == 2
    assert stats.data["hit_objects_by_tier"] == {"s3": 2}


class _LateClient(_LookupClient):
    """Its lookup replies come ``delay_s`` after the request (``None``: never); records how long
    each poll was allowed to wait."""

    def __init__(self, reply: object, delay_s: float | None) -> None:
        super().__init__(reply)
        self.delay_s, self.waits, self.sent = delay_s, [], 0.0  # type: ignore[var-annotated]

    def lookup_async(self, hashes: list[bytes], refs: object, **how: object) -> int:
        import time

        self.sent = time.monotonic()
        return super().lookup_async(hashes, refs, **how)

    def poll(self, req_id: int, wait_s: float = 0.0) -> object:
        import time

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
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    client = _LateClient(_hit_reply(chunks=2), delay_s=0.001)
    sched = _recurrent_scheduler(client=client, recurrent=False)
    # Not (None, False), "ask again next step": vLLM can schedule the request in this step.
    assert sched.get_num_new_matched_tokens(_prompt_request(), 0) == (2 * 768, False)  # type: ignore[attr-defined]
    assert client.waits == [ConnectorSettings().lookup_wait_s] and client.waits[0] > 0
    st = sched._reqs["r"]  # type: ignore[attr-defined]
    assert st.probe.ticket == HIT_TICKET
    assert st.slots == {0: {0: (0, HIT_BYTES, 0)}, 1: {0: (HIT_BYTES, HIT_BYTES, 0)}}
    blocks = SimpleNamespace(get_block_ids=lambda: (list(range(1, 8)),))
    sched.update_state_after_alloc(SimpleNamespace(request_id="r"), blocks, 2 * 768)  # type: ignore[attr-defined]
    (load,) = sched.build_connector_meta(_output([], {}, {})).loads  # type: ignore[attr-defined]
    assert [c.prefix_hash for c in load.chunks] == client.hashes[:2]
    assert [c.block_ids for c in load.chunks] == [[[1, 2]], [[3, 4]]]
    assert client.released == []  # never while a worker may copy from the slots
    sched.update_connector_output(SimpleNamespace(finished_recving=None, failed_recving=set()))  # type: ignore[attr-defined]
    assert client.released == [HIT_TICKET]


def test_with_lookup_wait_s_0_every_reply_is_collected_at_the_next_step() -> None:
    pytest.importorskip("vllm")
    client = _LateClient(_hit_reply(), delay_s=0.001)
    sched = _recurrent_scheduler(client=client, recurrent=False, settings=ConnectorSettings(lookup_wait_s=0))
    assert sched.get_num_new_matched_tokens(_prompt_request(), 0) == (None, False)  # type: ignore[attr-defined]
    assert client.waits == [0.0]


def test_a_silent_server_costs_one_step_at_most_lookup_wait_s_however_many_requests_arrive() -> None:
    pytest.importorskip("vllm")
    client = _LateClient(_hit_reply(), delay_s=None)
    settings = ConnectorSettings(lookup_wait_s=0.02)
    sched = _recurrent_scheduler(client=client, recurrent=False, settings=settings)
    for i in range(10):
        request = _prompt_request(request_id=f"r{i}")
        assert sched.get_num_new_matched_tokens(request, 0) == (None, False)  # type: ignore[attr-defined]
    assert client.waits[0] == 0.02 and sum(client.waits) <= 0.02 + 1e-9  # the step's budget, shared
    sched.build_connector_meta(_scheduled())  # type: ignore[attr-defined]  # the next step
    client.waits.clear()
    sched.get_num_new_matched_tokens(_prompt_request(request_id="late"), 0)  # type: ignore[attr-defined]
    assert client.waits == [0.02]  # a new step, a new budget


def _settled_after(sched: object, clock: _SteppedClock, steps: int) -> tuple[float, object]:
    """Ask about the request at every step (1 ms apart) until the lookup settles or ``steps`` ran:
    (the scheduler's seconds since the first ask, the answer or ``None``)."""
    began = clock.monotonic()
    for _ in range(steps):
        answer = sched.get_num_new_matched_tokens(_prompt_request(), 0)  # type: ignore[attr-defined]
        if answer != (None, False):
            return clock.monotonic() - began, answer
        clock.tick()
    return clock.monotonic() - began, None


def test_a_slow_promotion_is_given_up_after_timeout_s_not_the_in_flight_wait_too(
    stepped: _SteppedClock,
) -> None:
    client = _PendingClient(awaiting=0)  # the server is promoting from disk or S3
    settings = ConnectorSettings(timeout_s=0.2, inflight_wait_s=30.0, tails=False)
    sched = _recurrent_scheduler(client=client, recurrent=False, settings=settings)
    took, answer = _settled_after(sched, stepped, 10_000)
    assert answer == (0, False), "a promotion slower than timeout_s is computed instead"
    # Given up at the first poll past timeout_s (polls are at most 20 ms apart), not 30 s later.
    assert 0.2 < took <= 0.2 + 0.021


def test_a_wait_for_another_engines_store_gets_inflight_wait_s_on_top_of_timeout_s(
    stepped: _SteppedClock,
) -> None:
    client = _PendingClient(awaiting=2)  # a prefill engine's stores are still in flight
    settings = ConnectorSettings(timeout_s=0.2, inflight_wait_s=1.0, tails=False)
    sched = _recurrent_scheduler(client=client, recurrent=False, settings=settings)
    took, answer = _settled_after(sched, stepped, 10_000)
    assert answer == (0, False)
    assert 1.2 < took <= 1.2 + 0.021, f"gave up after {took:.3f} s, not at timeout_s + inflight_wait_s"


@pytest.mark.parametrize(
    ("role", "words"),
    [("kv_producer", "never loads"), ("kv_consumer", "never stores"), ("kv_both", "loads what")],
)
def test_the_start_up_line_says_what_the_role_does(role: str, words: str) -> None:
    pytest.importorskip("vllm")
    from tiercache.connector.connector import describe_role

    assert role in describe_role(role) and words in describe_role(role)


def test_the_connectors_lines_go_through_vllms_log_handlers() -> None:
    import logging

    pytest.importorskip("vllm")
    from tiercache.connector.connector import adopt_log_handlers

    theirs, ours = logging.getLogger("test-vllm-like"), logging.getLogger("test-tiercache-like")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    theirs.addHandler(handler)
    theirs.setLevel(logging.INFO)
    try:
        adopt_log_handlers(ours, theirs)
        adopt_log_handlers(ours, theirs)  # idempotent: one handler, one line
        ours.getChild("connector").info("tiercache: connected")
        ours.getChild("connector").debug("not at INFO")
        assert seen == ["tiercache: connected"]
        assert not ours.propagate
    finally:
        theirs.removeHandler(handler)
        ours.handlers.clear()
        ours.propagate = True
        ours.setLevel(logging.NOTSET)


@pytest.mark.parametrize("wait", [-1, 61, "soon"])
def test_inflight_wait_outside_its_range_is_refused(wait: object) -> None:
    with pytest.raises(ConfigError, match="inflight_wait_s"):
        ConnectorSettings.from_extra_config({"inflight_wait_s": wait})


# -- asynchronous loads: the scheduler half's side of vLLM's WAITING_FOR_REMOTE_KVS protocol ---------


class _TicketClient:
    """Records the tickets the scheduler half releases."""

    def __init__(self) -> None:
        self.released: list[int] = []
        self.read: list[bool] = []

    def release_ticket(self, ticket: int, *, read: bool = False) -> None:
        self.released.append(ticket)
        self.read.append(read)


def _hit_scheduler(asynchronous: bool) -> tuple[object, object, _TicketClient]:
    """A scheduler half (two KV-cache groups when ``asynchronous``, else as for a dense model) whose
    lookup for request "r" (1700 tokens) settled on a 2-chunk hit pinned by ticket 5."""
    from tiercache.connector.scheduler import LookupState, _Probe, _Request
    from tiercache.keys import ExtraKeys

    client = _TicketClient()
    # Two KV-cache groups make vLLM's loads asynchronous; one full-attention group keeps them in step.
    sched = _recurrent_scheduler(client=client, recurrent=asynchronous)
    st = _Request(
        "r",
        list(range(1700)),
        ExtraKeys(),
        state=LookupState.DONE,
        saved_upto=0,
        hit_chunks=2,
        probe=_Probe(ticket=5),
    )
    sched._reqs["r"] = st  # type: ignore[attr-defined]
    return sched, st, client


def _alloc(sched: object, tokens: int = 1536) -> None:
    from types import SimpleNamespace

    blocks = SimpleNamespace(get_block_ids=lambda: ([11, 12, 13, 14, 15], [0, 0, 0, 8, 9]))
    sched.update_state_after_alloc(SimpleNamespace(request_id="r"), blocks, tokens)  # type: ignore[attr-defined]


def _step_output(finished: set[str] = frozenset(), failed: set[str] = frozenset()) -> object:  # type: ignore[assignment]
    from types import SimpleNamespace

    return SimpleNamespace(finished_recving=set(finished) or None, failed_recving=set(failed))


@pytest.mark.parametrize("asynchronous", [True, False])
def test_several_kv_cache_groups_make_the_hit_asynchronous(asynchronous: bool) -> None:
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    sched, _, _ = _hit_scheduler(asynchronous)
    request = SimpleNamespace(request_id="r", prompt_token_ids=list(range(1700)))
    assert sched.get_num_new_matched_tokens(request, 0) == (1536, asynchronous)  # type: ignore[attr-defined]


def test_the_ticket_is_kept_until_the_workers_report_the_load() -> None:
    pytest.importorskip("vllm")
    sched, st, client = _hit_scheduler(True)
    _alloc(sched)
    assert sched.build_connector_meta(_output([], {}, {})).loads[0].req_id == "r"  # type: ignore[attr-defined]
    sched.update_connector_output(_step_output())  # type: ignore[attr-defined]  # parked: nothing reported yet
    sched.build_connector_meta(_output([], {}, {}))  # type: ignore[attr-defined]
    sched.update_connector_output(_step_output())  # type: ignore[attr-defined]
    assert client.released == [] and st.probe.ticket == 5 and st.loading  # type: ignore[attr-defined]
    sched.build_connector_meta(_output([], {}, {}))  # type: ignore[attr-defined]
    sched.update_connector_output(_step_output({"r"}))  # type: ignore[attr-defined]
    assert client.released == [5] and not st.loading and not st.load_failed  # type: ignore[attr-defined]


@pytest.mark.parametrize("failed", [False, True], ids=["loaded", "failed"])
def test_an_asynchronous_load_from_the_tickets_slots_releases_it_as_read_unless_it_failed(
    failed: bool,
) -> None:
    """The workers pinned nothing: the ticket's release is what tells the server its objects were
    read (L1 hits, eviction order); a failed load read nothing it could use."""
    pytest.importorskip("vllm")
    import time

    sched, st, client = _hit_scheduler(True)
    st.probe.sent_at, st.probe.arena = time.monotonic(), "tiercache-arena"  # type: ignore[attr-defined]
    st.slots = {
        c: {0: (2 * c * HIT_BYTES, HIT_BYTES, 0), 1: ((2 * c + 1) * HIT_BYTES, HIT_BYTES, 0)}
        for c in (0, 1, 2)
    }  # type: ignore[attr-defined]
    _alloc(sched)
    (load,) = sched.build_connector_meta(_output([], {}, {})).loads  # type: ignore[attr-defined]
    assert load.asynchronous and load.arena == "tiercache-arena" and load.leased_at == st.probe.sent_at  # type: ignore[attr-defined]
    sched.update_connector_output(_step_output({"r"}, {"r"} if failed else set()))  # type: ignore[attr-defined]
    assert client.released == [5] and client.read == [not failed]


def test_a_synchronous_hit_releases_the_ticket_once_its_step_ran() -> None:
    pytest.importorskip("vllm")
    sched, _, client = _hit_scheduler(False)
    _alloc(sched)
    assert not sched.build_connector_meta(_output([], {}, {})).loads[0].asynchronous  # type: ignore[attr-defined]
    sched.update_connector_output(_step_output())  # type: ignore[attr-defined]
    assert client.released == [5]


def test_after_a_failed_load_the_retry_computes() -> None:
    """vLLM frees a failed request's blocks and schedules it again from token 0 (asking for a match
    again): the cache offers nothing, so the retry never waits on the same failure twice."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    sched, _, client = _hit_scheduler(True)
    _alloc(sched)
    sched.build_connector_meta(_output([], {}, {}))  # type: ignore[attr-defined]
    sched.update_connector_output(_step_output({"r"}, {"r"}))  # type: ignore[attr-defined]
    assert client.released == [5]
    request = SimpleNamespace(request_id="r", prompt_token_ids=list(range(1700)))
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)  # type: ignore[attr-defined]


def test_a_request_finished_while_loading_releases_its_ticket_once_after_the_load_step() -> None:
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    sched, _, client = _hit_scheduler(True)
    _alloc(sched)
    sched.build_connector_meta(_output([], {}, {}))  # type: ignore[attr-defined]  # step 1 carries the load
    assert sched.request_finished(SimpleNamespace(request_id="r")) == (False, None)  # type: ignore[attr-defined]
    sched.update_connector_output(_step_output({"r"}))  # type: ignore[attr-defined]  # step 1 ran
    assert client.released == []  # released after the next step: never while a worker may copy
    sched.build_connector_meta(_output([], {}, {}))  # type: ignore[attr-defined]
    sched.update_connector_output(_step_output())  # type: ignore[attr-defined]
    assert client.released == [5] and sched._reqs == {}  # type: ignore[attr-defined]


def test_a_preempted_request_loading_anew_is_not_held_for_its_earlier_stores() -> None:
    """Its earlier stores were flushed at the preemption. Finished while loading, vLLM frees it on
    finished_recving; holding it for finished_sending as well would report a freed request."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    sched, st, _ = _hit_scheduler(True)
    st.saves_scheduled = 2  # type: ignore[attr-defined]  # stores of the run before the preemption
    _alloc(sched)
    assert sched.request_finished(SimpleNamespace(request_id="r")) == (False, None)  # type: ignore[attr-defined]


def test_a_load_whose_blocks_are_missing_is_sent_incomplete() -> None:
    """vLLM counts every external token as computed once the load is reported: a chunk the
    scheduler cannot place makes the workers report the whole load failed."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    sched, _, _ = _hit_scheduler(True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([11, 12, 13], [0, 0, 0]))
    sched.update_state_after_alloc(SimpleNamespace(request_id="r"), blocks, 1536)  # type: ignore[attr-defined]
    (load,) = sched.build_connector_meta(_output([], {}, {})).loads  # type: ignore[attr-defined]
    assert load.asynchronous and not load.complete


def test_plugin_registration_is_idempotent() -> None:
    from tiercache.connector import plugin

    plugin.register()
    plugin.register()  # vLLM may load general plugins more than once per process
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        return  # no vLLM here: register() is a no-op
    assert plugin.CONNECTOR_NAME in KVConnectorFactory._registry
    from tiercache.connector.connector import TierCacheConnector

    assert KVConnectorFactory._registry[plugin.CONNECTOR_NAME]() is TierCacheConnector


# -- start-up rules for recurrent (Mamba/GDN) groups ------------------------------------------------


def _recurrent(**kw: object) -> list[str]:
    from tiercache.connector.layout import check_recurrent_config

    args: dict[str, object] = {
        "mamba_cache_mode": "align",
        "enable_prefix_caching": True,
        "max_num_batched_tokens": 768,
        "block_size": 384,
        "chunk_size": 384,
        "separate_object_groups": True,
    }
    args.update(kw)
    return check_recurrent_config(**args)  # type: ignore[arg-type]


def test_recurrent_config_that_works() -> None:
    assert _recurrent() == [
        "recurrent state exists only every 768 tokens (prefill step), so hits are multiples of 768 tokens, not of the chunk size 384"
    ]
    assert _recurrent(max_num_batched_tokens=384) == []
    assert _recurrent(max_num_batched_tokens=800, chunk_size=768) == []  # steps of 768 (whole blocks)
    assert _recurrent(max_num_batched_tokens=384, separate_object_groups=False, chunk_size=768) == []


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"mamba_cache_mode": "none"}, 'mamba_cache_mode="align"'),
        ({"mamba_cache_mode": None}, "--mamba-cache-mode align"),
        ({"enable_prefix_caching": False}, "--enable-prefix-caching"),
        ({"max_num_batched_tokens": 256}, "at least 384"),
        ({"max_num_batched_tokens": 1152, "chunk_size": 768}, "multiple or a divisor of 768"),
        ({"separate_object_groups": False}, "divisor of 384"),
    ],
)
def test_recurrent_config_errors_name_the_fix(kw: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        _recurrent(**kw)


def test_mamba2_on_cpu_needs_steps_of_one_block() -> None:
    """vLLM 0.32's CPU Mamba2 scan cannot export a mid-step checkpoint: any step longer than one
    block (even 500 tokens with N = 384: a prompt's last step may cross a boundary) kills the engine."""
    assert _recurrent(max_num_batched_tokens=384, in_step_checkpoints_on_cpu=True) == []
    for tokens in (500, 768):
        with pytest.raises(ConfigError, match="set --max-num-batched-tokens 384"):
            _recurrent(max_num_batched_tokens=tokens, in_step_checkpoints_on_cpu=True)


def test_in_step_checkpoints_are_detected_from_the_spec_and_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    from tiercache.connector import layout

    mamba2 = _fake_spec("MambaSpec", num_speculative_blocks=0, num_prefill_checkpoint_blocks=1)
    gdn = _fake_spec("MambaSpec", num_speculative_blocks=0, num_prefill_checkpoint_blocks=0)
    full = _fake_spec("FullAttentionSpec", num_prefill_checkpoint_blocks=1)  # not a recurrent group
    monkeypatch.setattr(layout, "_platform_extras", lambda: (("device", "cpu"),))
    assert layout.cpu_in_step_checkpoints([mamba2, _fake_spec("FullAttentionSpec")])
    assert not layout.cpu_in_step_checkpoints([gdn, full])
    monkeypatch.setattr(layout, "_platform_extras", lambda: (("device", "cuda"),))
    assert not layout.cpu_in_step_checkpoints([mamba2])


def test_recurrent_mode_error_names_prefix_caching_too() -> None:
    """vLLM 0.33 derives mamba_cache_mode from prefix caching (--mamba-cache-mode is a no-op there)."""
    with pytest.raises(ConfigError, match="--enable-prefix-caching"):
        _recurrent(mamba_cache_mode="none")


def test_the_vllm_plugin_entry_point_is_installed() -> None:
    import importlib.metadata

    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.value == "tiercache.connector.plugin:register" for ep in plugins)


# -- the worker half's recurrent loads (a fake arena and client; needs vLLM for the metadata) --------


class _FakeArena:
    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.buf)[offset : offset + nbytes]


def _recurrent_worker(slot_bytes: list[int]) -> tuple[object, _FakeArena]:
    """A WorkerHalf with kv group 0 full attention (2 blocks per chunk, 16-byte pages) and kv group 1
    recurrent (8-byte state pages), 10 blocks each, all 0xEE; its fake client pins one slot per key
    with the given sizes, each slot's bytes filled with its index + 1."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    import torch

    from tiercache.connector.copy import CpuPageCopy
    from tiercache.connector.layout import GroupLayout
    from tiercache.connector.pages import page_view
    from tiercache.connector.worker import WorkerHalf
    from tiercache.keys import Fingerprint
    from tiercache.keys.digest import digest
    from tiercache.wire import protocol as p

    arena = _FakeArena(sum(slot_bytes))
    offsets = [sum(slot_bytes[:i]) for i in range(len(slot_bytes))]
    for i, (off, n) in enumerate(zip(offsets, slot_bytes)):
        arena.buf[off : off + n] = bytes([i + 1]) * n
    slots = [
        p.Slot(b"", o, n, i + 1, digest(arena.view(o, n)))
        for i, (o, n) in enumerate(zip(offsets, slot_bytes))
    ]
    client = SimpleNamespace(
        pin=lambda keys, timeout=None: slots[: len(keys)],
        arena=lambda: arena,
        in_session=lambda call: (call(), arena),  # one arena: the "server" never restarts
        clock=time.monotonic,
        lease_window_s=100.0,
        release_unanswered=lambda tokens: None,  # every lease was held for the whole copy
        report_corrupt=lambda slots: None,
    )
    w = WorkerHalf(None, None, ConnectorSettings(overlap_loads=True), link=link_to(client))
    w.use_layout(
        [
            GroupLayout(0, 0, 0, ("attn",), 384, 2, 16, None),  # type: ignore[arg-type]
            GroupLayout(1, 1, 0, ("gdn",), 384, 1, 8, None, recurrent=True),  # type: ignore[arg-type]
        ],
        {
            0: [
                page_view(
                    "attn", torch.full((10, 16), 0xEE, dtype=torch.uint8), page_bytes=16, kernel_blocks=1
                )
            ],
            1: [
                page_view("gdn", torch.full((10, 8), 0xEE, dtype=torch.uint8), page_bytes=8, kernel_blocks=1)
            ],
        },
        {0: Fingerprint(b"\0" * 16), 1: Fingerprint(b"\1" * 16)},
        CpuPageCopy(),
    )
    w.order_layers(["attn", "gdn"])
    return w, arena


def _reported(w: object) -> tuple[set[str], set[str], set[str]]:
    """The first non-empty ``transfer_results`` (an asynchronous load is written in the background
    and reported at the end of the first step after its writes are done)."""

    def reported() -> tuple[set[str], set[str], set[str]] | None:
        result = w.transfer_results(set())  # type: ignore[attr-defined]
        return result if any(result) else None  # type: ignore[no-any-return]

    return wait_until(reported, timeout=10, interval=0.001, what="the load's report")


def _two_chunk_hit(asynchronous: bool = True) -> object:
    from tiercache.connector.metadata import ChunkLoad, RequestLoad, TierCacheMetadata

    return TierCacheMetadata(
        step=1,
        loads=[
            RequestLoad(
                "r",
                [
                    ChunkLoad(b"0" * 16, [[0, 1], []], [[1, 2], []]),
                    ChunkLoad(b"1" * 16, [[0, 1], [0]], [[3, 4], [7]], state=True),
                ],
                asynchronous=asynchronous,
            )
        ],
    )


def test_the_state_object_lands_in_the_boundary_block_once_per_step() -> None:
    # Keys in order: chunk 0 attention, chunk 1 attention, chunk 1 state.
    w, _ = _recurrent_worker([32, 32, 8])
    meta = _two_chunk_hit()
    w.handle_preemptions(meta)  # type: ignore[attr-defined]
    w.start_load_kv(meta)  # type: ignore[attr-defined]  # already done by handle_preemptions: no-op
    assert _reported(w) == (set(), {"r"}, set())
    pages = {g: [pv.view for pv in layers] for g, layers in w._pages.items()}  # type: ignore[attr-defined]
    assert pages[1][0][7].tolist() == [3] * 8  # the state object, in the block vLLM assigned
    assert pages[0][0][1].tolist() == [1] * 16 and pages[0][0][4].tolist() == [2] * 16
    assert pages[1][0][0].tolist() == [0xEE] * 8  # the null block is never written
    assert w.stats["loaded_chunks"] == 2 and w.stats["load_failures"] == 0  # type: ignore[attr-defined]
    assert w.get_block_ids_with_load_errors() == set()  # type: ignore[attr-defined]
    assert w.transfer_results(set()) == (set(), set(), set())  # type: ignore[attr-defined]  # reported once


def test_without_overlap_an_asynchronous_load_is_reported_in_the_step_that_starts_it() -> None:
    w, _ = _recurrent_worker([32, 32, 8])
    w._overlap = False  # type: ignore[attr-defined]  # the default
    w.handle_preemptions(_two_chunk_hit())  # type: ignore[attr-defined]
    assert w.transfer_results(set()) == (set(), {"r"}, set())  # type: ignore[attr-defined]
    assert w._pages[1][0].view[7].tolist() == [3] * 8  # type: ignore[attr-defined]


def test_a_failed_chunk_fails_the_whole_asynchronous_load_without_block_ids() -> None:
    """A state object of the wrong size fails chunk 1: the request is reported finished and failed
    (vLLM frees its blocks and computes it from scratch); no block ids, which vLLM cannot map back
    to requests with several KV-cache groups."""
    w, _ = _recurrent_worker([32, 32, 4])
    w.handle_preemptions(_two_chunk_hit())  # type: ignore[attr-defined]
    assert _reported(w) == (set(), {"r"}, {"r"})
    assert w.get_block_ids_with_load_errors() == set()  # type: ignore[attr-defined]
    assert w.stats["loaded_chunks"] == 1 and w.stats["load_failures"] == 1  # type: ignore[attr-defined]


def test_every_worker_reports_each_asynchronous_load_even_with_nothing_to_copy() -> None:
    """vLLM counts finished_recving per worker (KVOutputAggregator): a load with no chunk this worker
    could place (``complete`` False), or no server, is still reported, as failed."""
    pytest.importorskip("vllm")
    from tiercache.connector.metadata import RequestLoad, TierCacheMetadata

    w, _ = _recurrent_worker([])
    w.handle_preemptions(
        TierCacheMetadata(step=1, loads=[RequestLoad("r", [], asynchronous=True, complete=False)])
    )  # type: ignore[attr-defined]
    assert _reported(w) == (set(), {"r"}, {"r"})
    w, _ = _recurrent_worker([32, 32, 8])
    w.link = type("DownLink", (), {"client": lambda self: None})()  # type: ignore[attr-defined]
    w.handle_preemptions(_two_chunk_hit())  # type: ignore[attr-defined]
    assert _reported(w) == (set(), {"r"}, {"r"})


def test_an_asynchronous_load_forgets_the_requests_earlier_stores() -> None:
    """The worker's side of the scheduler's rule: once finished, the request is not reported in
    finished_sending for stores of a run before its preemption."""
    w, _ = _recurrent_worker([32, 32, 8])
    w._with_saves.add("r")  # type: ignore[attr-defined]
    w.handle_preemptions(_two_chunk_hit())  # type: ignore[attr-defined]
    assert _reported(w) == (set(), {"r"}, set())
    assert w.transfer_results({"r"}) == (set(), set(), set())  # type: ignore[attr-defined]


def test_a_synchronous_load_reports_the_blocks_of_its_failed_chunks() -> None:
    """One KV-cache group (dense models): vLLM recomputes from the first invalid block."""
    pytest.importorskip("vllm")
    from tiercache.connector.metadata import ChunkLoad, RequestLoad, TierCacheMetadata

    w, _ = _recurrent_worker([32, 4])
    w._groups = w._groups[:1]  # type: ignore[attr-defined]
    meta = TierCacheMetadata(
        step=1,
        loads=[
            RequestLoad(
                "r",
                [
                    ChunkLoad(b"0" * 16, [[0, 1]], [[1, 2]]),
                    ChunkLoad(b"1" * 16, [[0, 1]], [[3, 4]]),
                ],
            )
        ],
    )
    w.handle_preemptions(meta)  # type: ignore[attr-defined]
    assert w.get_block_ids_with_load_errors() == {3, 4}  # type: ignore[attr-defined]
    assert w.transfer_results(set()) == (set(), set(), set())  # type: ignore[attr-defined]


# -- vLLM >= 0.33 sleep-mode hooks (0.32 never calls them; the tests call them directly) -------------


def test_sleep_mode_hooks_match_vllm_and_drain_queued_stores() -> None:
    """``unregister_kv_caches`` (called before sleep mode releases the KV memory) returns only once
    the loads writing into the KV cache and the stores queued for the save thread are done;
    ``restore_kv_caches`` needs nothing. Where the installed vLLM declares the hooks (0.33+), ours
    take the same arguments."""
    pytest.importorskip("vllm")
    import inspect
    import threading
    import time

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from tiercache.connector.connector import TierCacheConnector

    for name in ("unregister_kv_caches", "restore_kv_caches"):
        base = getattr(KVConnectorBase_V1, name, None)
        if base is not None:
            assert list(inspect.signature(base).parameters) == list(
                inspect.signature(getattr(TierCacheConnector, name)).parameters
            )

    w, _ = _recurrent_worker([32, 32, 8])
    w.handle_preemptions(_two_chunk_hit())  # type: ignore[attr-defined]  # an asynchronous load in flight
    w._pending = {"r": 2}  # type: ignore[attr-defined]
    done: list[float] = []

    def save_thread() -> None:  # what WorkerHalf._save_loop does when a batch is stored
        time.sleep(0.2)
        with w._idle:  # type: ignore[attr-defined]
            del w._pending["r"]  # type: ignore[attr-defined]
            done.append(time.monotonic())
            w._idle.notify_all()  # type: ignore[attr-defined]

    c = TierCacheConnector.__new__(TierCacheConnector)
    c._worker, c._scheduler = w, None
    t = threading.Thread(target=save_thread)
    t.start()
    c.unregister_kv_caches()
    returned = time.monotonic()
    t.join()
    assert done and done[0] <= returned and w._pending == {}  # type: ignore[attr-defined]
    assert w.transfer_results(set()) == (set(), {"r"}, set())  # type: ignore[attr-defined]  # the load is done
    assert w._pages[1][0].view[7].tolist() == [3] * 8  # type: ignore[attr-defined]
    c.unregister_kv_caches()  # idempotent: nothing queued
    c.restore_kv_caches()
    s = TierCacheConnector.__new__(TierCacheConnector)
    s._worker, s._scheduler = None, object()
    s.unregister_kv_caches()  # the scheduler's instance holds no KV memory
    s.restore_kv_caches()


# -- tails (tiercache.connector.tails): the blocks past the last full chunk ---------------------------


def _tails_scheduler(client: object, **kw: object) -> object:
    """A dense scheduler (chunk 768 = 2 blocks of 384) with tails on."""
    return _recurrent_scheduler(client=client, recurrent=False, settings=ConnectorSettings(tails=True), **kw)  # type: ignore[arg-type]


def test_tails_are_on_for_dense_layouts_and_off_for_recurrent_state() -> None:
    pytest.importorskip("vllm")
    assert _tails_scheduler(object())._tail_block == 384  # type: ignore[attr-defined]
    assert _recurrent_scheduler(settings=ConnectorSettings(tails=True))._tail_block == 0  # type: ignore[attr-defined]
    assert _recurrent_scheduler(recurrent=False, settings=ConnectorSettings(tails=False))._tail_block == 0  # type: ignore[attr-defined]
    assert _recurrent_scheduler(recurrent=False, settings=ConnectorSettings())._tail_block == 384  # type: ignore[attr-defined]  # on by default


def test_a_hit_ends_at_the_last_tail_block_found_and_loads_it_into_its_block() -> None:
    """2000 tokens: 2 full chunks, then 1 full block of chunk 2 short of the last token. The
    server holds all three: the hit is 1920 tokens, the tail asked for every object of its block."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    client = _LookupClient(_hit_reply(chunks=2))
    sched = _tails_scheduler(client)
    got = sched.get_num_new_matched_tokens(_prompt_request(2000), 0)  # type: ignore[attr-defined]
    assert got == (2 * 768 + 384, False)
    (chunks, _), (blocks, tail_how) = client.asked
    assert (chunks, blocks) == (2, 1) and tail_how["kind"] is LookupKind.TAIL
    ids = list(range(1, 8))
    sched.update_state_after_alloc(
        SimpleNamespace(request_id="r"), SimpleNamespace(get_block_ids=lambda: (ids,)), 1920
    )  # type: ignore[attr-defined]
    meta = sched.build_connector_meta(_output([], {}, {}))  # type: ignore[attr-defined]
    (load,) = meta.loads
    assert [(c.block_ids, c.blocks) for c in load.chunks] == [([[1, 2]], 0), ([[3, 4]], 0), ([[5]], 1)]
    assert load.chunks[2].prefix_hash == client.hashes[0]


def test_a_producer_stores_its_prompts_tail_and_never_asks_for_one() -> None:
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from tiercache.wire.protocol import LookupReply

    client = _LookupClient(LookupReply(chunks=0, per_tier={}))
    sched = _tails_scheduler(client, loads=False)
    assert sched.get_num_new_matched_tokens(_prompt_request(2000), 0) == (0, False)  # type: ignore[attr-defined]
    assert len(client.asked) == 1  # the chunks' lookup only
    new = SimpleNamespace(req_id="r", block_ids=(list(range(1, 8)),), num_computed_tokens=0)
    meta = sched.build_connector_meta(_output([new], {}, {"r": 2000}))  # type: ignore[attr-defined]
    assert [(s.chunk_index, s.block_ids, s.blocks) for s in meta.saves] == [
        (0, [[1, 2]], 0),
        (1, [[3, 4]], 0),
        (2, [[5]], 1),  # the full block of chunk 2 (tokens 1536..1919)
    ]
    # Each full chunk names the tail of its first block, which its commit supersedes.
    assert [len(s.supersedes) for s in meta.saves] == [1, 1, 0]


def test_a_finished_request_stores_its_generated_tokens_and_supersedes_the_prompts_tail() -> None:
    """A producer stores its prompt's tail once computed; when the request ends its generated
    tokens fill chunk 2, whose store supersedes that tail."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from tiercache.wire.protocol import LookupReply

    client = _LookupClient(LookupReply(chunks=0, per_tier={}))
    sched = _tails_scheduler(client, loads=False)
    request = _prompt_request(2000)
    sched.get_num_new_matched_tokens(request, 0)  # type: ignore[attr-defined]
    new = SimpleNamespace(req_id="r", block_ids=(list(range(1, 8)),), num_computed_tokens=0)
    prompt_tail = sched.build_connector_meta(_output([new], {}, {"r": 2000})).saves[-1]  # type: ignore[attr-defined]
    # 400 generated: the KV of all but the last sampled token exists, so chunk 2 is full now.
    done = SimpleNamespace(
        **vars(request), all_token_ids=[*range(2000), *range(400)], num_computed_tokens=2399
    )
    assert sched.request_finished(done) == (True, None)  # type: ignore[attr-defined]
    meta = sched.build_connector_meta(_output([], {}, {}))  # type: ignore[attr-defined]
    assert [(s.chunk_index, s.block_ids, s.blocks) for s in meta.saves] == [(2, [[5, 6]], 0)]
    assert meta.saves[0].supersedes == [prompt_tail.prefix_hash]


def test_a_request_stores_its_tail_once_at_its_end_with_its_prompts_blocks() -> None:
    """kv_both, a full-attention model: no tail when the prompt is computed; at the request's end,
    one object of the prompt's and the answer's full blocks of the last chunk."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from tiercache.wire.protocol import LookupReply

    client = _LookupClient(LookupReply(chunks=0, per_tier={}))
    sched = _four_block_tails_scheduler(client)
    request = _prompt_request(2000)
    request.max_tokens = 201  # type: ignore[attr-defined]  # (its answer may add blocks to the tail)
    sched.get_num_new_matched_tokens(request, 0)  # type: ignore[attr-defined]
    new = SimpleNamespace(req_id="r", block_ids=(list(range(1, 13)),), num_computed_tokens=0)
    meta = sched.build_connector_meta(_output([new], {}, {"r": 2000}))  # type: ignore[attr-defined]
    assert [s.blocks for s in meta.saves] == [0, 0]  # the two full chunks only
    done = SimpleNamespace(
        **vars(request), all_token_ids=[*range(2000), *range(200)], num_computed_tokens=2199
    )
    assert sched.request_finished(done) == (True, None)  # type: ignore[attr-defined]
    (tail,) = sched.build_connector_meta(_output([], {}, {})).saves  # type: ignore[attr-defined]
    assert (tail.chunk_index, tail.block_ids, tail.blocks) == (2, [[9, 10, 11]], 3)


def _four_block_tails_scheduler(client: object, **kw: object) -> object:
    """A dense scheduler (chunk 768 = 4 blocks of 192, one layer of 196608 bytes a block) with tails on."""
    return _recurrent_scheduler(  # type: ignore[arg-type]
        768, 192, client=client, recurrent=False, settings=ConnectorSettings(tails=True), **kw
    )


def _tail_reply(target: bytes, *, blocks: int, object_blocks: int, arena: str = "tiercache-arena") -> object:
    """A tail lookup's READY reply: ``blocks`` found in the object ``target`` of ``object_blocks``
    blocks (one layer of 196608 bytes a block), pinned under ticket ``HIT_TICKET + 1`` in ``arena``."""
    from tiercache.keys import ObjectKey
    from tiercache.keys.fingerprint import Fingerprint
    from tiercache.wire.protocol import LookupReply, Slot, TicketStateName

    key = ObjectKey(Fingerprint(bytes(16)), 0, target).to_bytes()
    return LookupReply(
        chunks=blocks,
        per_tier={"l1": 1},
        state=TicketStateName.READY,
        ticket=HIT_TICKET + 1,
        ready_chunks=1,
        slots=[Slot(key, 0, object_blocks * 196608, 200)],
        arena=arena,
    )


class _SequencedClient(_LookupClient):
    """Answers the lookups with ``replies`` in turn (each a reply, or a function of the hashes asked)."""

    def __init__(self, *replies: object) -> None:
        super().__init__(None)
        self._replies = list(replies)

    def lookup_async(self, hashes: list[bytes], refs: object, **how: object) -> int:
        self.reply = self._replies.pop(0)
        return super().lookup_async(hashes, refs, **how)


def test_a_tail_lookup_answered_with_the_chunk_holding_the_blocks_loads_its_first_blocks() -> None:
    """2000 tokens: 2 full chunks, then 2 full blocks of chunk 2 short of the last token. The server
    holds chunk 2 whole (stored by a longer request): its block index answers the tail lookup with
    that object, keyed by a hash this prompt cannot name, and the load reads its first 2 blocks."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    chunk2 = b"\x07" * 16  # the whole chunk's prefix hash
    client = _SequencedClient(_hit_reply(chunks=2), _tail_reply(chunk2, blocks=2, object_blocks=4))
    sched = _four_block_tails_scheduler(client)
    assert sched.get_num_new_matched_tokens(_prompt_request(2000), 0) == (2 * 768 + 2 * 192, False)  # type: ignore[attr-defined]
    ids = list(range(1, 12))
    sched.update_state_after_alloc(
        SimpleNamespace(request_id="r"), SimpleNamespace(get_block_ids=lambda: (ids,)), 1920
    )  # type: ignore[attr-defined]
    (load,) = sched.build_connector_meta(_output([], {}, {})).loads  # type: ignore[attr-defined]
    tail = load.chunks[-1]
    assert (tail.prefix_hash, tail.positions, tail.block_ids, tail.blocks) == (chunk2, [[0, 1]], [[9, 10]], 4)


def _tail_load(client: object) -> object:
    """The load a 2000-token prompt gets from ``client``'s replies (two chunks, then a tail of 2
    blocks in chunk 2), once its blocks are allocated; the step that carries it has run."""
    from types import SimpleNamespace

    sched = _four_block_tails_scheduler(client)
    sched.get_num_new_matched_tokens(_prompt_request(2000), 0)  # type: ignore[attr-defined]
    ids = list(range(1, 12))
    sched.update_state_after_alloc(
        SimpleNamespace(request_id="r"), SimpleNamespace(get_block_ids=lambda: (ids,)), 1920
    )  # type: ignore[attr-defined]
    (load,) = sched.build_connector_meta(_output([], {}, {})).loads  # type: ignore[attr-defined]
    sched.update_connector_output(_step_output())  # type: ignore[attr-defined]
    return load


def test_a_load_names_where_the_lookups_tickets_pinned_its_objects_and_when_they_were_sent() -> None:
    """So the workers copy from there without pinning again: each chunk's slot per object group,
    the tail object's too, the arena the replies said they are in, and the earliest send of the
    lookups that pinned them (no lease of theirs started before it). The tickets are released as
    read: the server counts their objects as L1 hits."""
    pytest.importorskip("vllm")
    import time

    chunk2 = b"\x07" * 16
    client = _SequencedClient(_hit_reply(chunks=2), _tail_reply(chunk2, blocks=2, object_blocks=4))
    before = time.monotonic()
    load = _tail_load(client)
    assert load.arena == "tiercache-arena" and before <= load.leased_at <= time.monotonic()
    assert [c.slots for c in load.chunks] == [
        [(0, 0, HIT_BYTES, 0)],
        [(0, HIT_BYTES, HIT_BYTES, 0)],
        [(0, 0, 4 * 196608, 0)],  # the tail object's, from the tail lookup's reply
    ]
    assert sorted(client.released) == [HIT_TICKET, HIT_TICKET + 1] and client.read == [True, True]


def test_slots_from_two_arenas_are_not_named_the_workers_pin_by_key() -> None:
    """The chunks' lookup answered by one server and the tail's by another (restarted in between:
    the client says hello again by itself): no single arena holds every slot, so the load names
    none, and its tickets are not counted as read."""
    pytest.importorskip("vllm")
    chunk2 = b"\x07" * 16
    client = _SequencedClient(
        _hit_reply(chunks=2, arena="tiercache-old"), _tail_reply(chunk2, blocks=2, object_blocks=4)
    )
    load = _tail_load(client)
    assert load.arena == "" and load.leased_at == 0.0
    assert client.read == [False, False]


def test_a_tail_lookup_answered_with_an_object_of_the_wrong_size_is_a_miss() -> None:
    """An object that cannot hold the blocks the reply counts (here 1 block for 2) is never loaded."""
    pytest.importorskip("vllm")
    client = _SequencedClient(_hit_reply(chunks=2), _tail_reply(b"\x07" * 16, blocks=2, object_blocks=1))
    sched = _four_block_tails_scheduler(client)
    assert sched.get_num_new_matched_tokens(_prompt_request(2000), 0) == (2 * 768, False)  # type: ignore[attr-defined]
    assert HIT_TICKET + 1 in client.released or sched._reqs["r"].tail.probe.ticket == 0  # type: ignore[attr-defined]


def test_a_tail_is_one_object_of_the_chunks_first_blocks_superseding_the_shorter_one() -> None:
    """A producer's prompt of 2000 tokens stores chunk 2's first 2 blocks as one object keyed by the
    second's tail hash; the request ends (here after more tokens) with 3 full blocks there, stored as one object of all 3
    that supersedes the first. Each names the blocks it holds, for the server's block index."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from tiercache.keys import ExtraKeys, PrefixHasher, tail_hashes
    from tiercache.wire.protocol import LookupReply

    client = _LookupClient(LookupReply(chunks=0, per_tier={}))
    sched = _four_block_tails_scheduler(client, loads=False)  # a producer: its prompt's tail at once
    request = _prompt_request(2000)
    sched.get_num_new_matched_tokens(request, 0)  # type: ignore[attr-defined]
    new = SimpleNamespace(req_id="r", block_ids=(list(range(1, 13)),), num_computed_tokens=0)
    meta = sched.build_connector_meta(_output([new], {}, {"r": 2000}))  # type: ignore[attr-defined]
    tokens = [*range(2000), *range(200)]
    hasher = PrefixHasher(768, ExtraKeys())
    hasher.update(tokens)
    t = tail_hashes(hasher.before(2), tokens[1536 : 1536 + 3 * 192], 192)
    chunk0, _chunk1, prompt_tail = meta.saves
    assert (prompt_tail.chunk_index, prompt_tail.block_ids, prompt_tail.blocks) == (2, [[9, 10]], 2)
    assert (prompt_tail.prefix_hash, prompt_tail.holds, prompt_tail.supersedes) == (t[1], t[:2], t[:1])
    # A full chunk holds its first 3 blocks' tails and supersedes them.
    assert len(chunk0.holds) == len(chunk0.supersedes) == 3 and chunk0.holds == chunk0.supersedes
    done = SimpleNamespace(**vars(request), all_token_ids=tokens, num_computed_tokens=2199)
    assert sched.request_finished(done) == (True, None)  # type: ignore[attr-defined]
    (end_tail,) = sched.build_connector_meta(_output([], {}, {})).saves  # type: ignore[attr-defined]
    assert (end_tail.chunk_index, end_tail.block_ids, end_tail.blocks) == (2, [[9, 10, 11]], 3)
    assert (end_tail.prefix_hash, end_tail.holds, end_tail.supersedes) == (t[2], t, t[:2])


def test_a_request_whose_answer_cannot_add_a_block_stores_its_tail_once_its_prompt_is_computed() -> None:
    """max_tokens 8 after 2000 tokens (blocks of 192): the KV at the end stays inside the prompt's
    last block, so the end's tail would be the prompt's: stored at once (not lost if no step
    follows the request's end, as after an offline generate call's last request)."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from tiercache.wire.protocol import LookupReply

    client = _LookupClient(LookupReply(chunks=0, per_tier={}))
    sched = _four_block_tails_scheduler(client)
    request = _prompt_request(2000)
    request.max_tokens = 8  # type: ignore[attr-defined]
    sched.get_num_new_matched_tokens(request, 0)  # type: ignore[attr-defined]
    new = SimpleNamespace(req_id="r", block_ids=(list(range(1, 13)),), num_computed_tokens=0)
    meta = sched.build_connector_meta(_output([new], {}, {"r": 2000}))  # type: ignore[attr-defined]
    assert [(s.chunk_index, s.blocks) for s in meta.saves] == [(0, 0), (1, 0), (2, 2)]
    done = SimpleNamespace(**vars(request), all_token_ids=[*range(2000), *range(8)], num_computed_tokens=2007)
    assert sched.request_finished(done) == (True, None)  # type: ignore[attr-defined]
    assert not sched.build_connector_meta(_output([], {}, {})).saves  # type: ignore[attr-defined]


def test_a_replay_that_found_its_own_tail_does_not_store_it_again() -> None:
    """A request whose tail lookup found the very object its end would store (the same blocks: a
    replay of a stored turn) stores nothing at its end."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from tiercache.keys import ExtraKeys, PrefixHasher, tail_hashes

    tokens = [*range(2000), *range(200)]
    hasher = PrefixHasher(768, ExtraKeys())
    hasher.update(tokens)
    end_tail = tail_hashes(hasher.before(2), tokens[1536 : 1536 + 3 * 192], 192)[-1]
    client = _SequencedClient(_hit_reply(chunks=2), _tail_reply(end_tail, blocks=2, object_blocks=3))
    sched = _four_block_tails_scheduler(client)
    request = _prompt_request(2000)
    request.max_tokens = 201  # type: ignore[attr-defined]
    assert sched.get_num_new_matched_tokens(request, 0) == (2 * 768 + 2 * 192, False)  # type: ignore[attr-defined]
    ids = list(range(1, 13))
    sched.update_state_after_alloc(
        SimpleNamespace(request_id="r"), SimpleNamespace(get_block_ids=lambda: (ids,)), 1920
    )  # type: ignore[attr-defined]
    new = SimpleNamespace(req_id="r", block_ids=(ids,), num_computed_tokens=1920)
    sched.build_connector_meta(_output([new], {}, {"r": 80}))  # type: ignore[attr-defined]
    done = SimpleNamespace(**vars(request), all_token_ids=tokens, num_computed_tokens=2199)
    sched.request_finished(done)  # type: ignore[attr-defined]
    assert not sched.build_connector_meta(_output([], {}, {})).saves  # type: ignore[attr-defined]
