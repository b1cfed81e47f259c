"""The scheduler half: runs in vLLM's scheduler (EngineCore) process, on the engine loop.

Nothing here may wait on the server: lookups go out with :meth:`Client.lookup_async` and are
collected with :meth:`Client.poll`; while one is outstanding ``get_num_new_matched_tokens`` answers
``None`` ("not known yet, ask again next step"). The short loop-side calls (release of a ticket,
registration at start-up) are round trips bounded by ``timeout_s``; any failure makes the link go
down, and while it is down every request is a miss.

Per request this half hashes the prompt's full chunks (``PrefixHasher``, seeded with the cache salt
and LoRA name), looks them up, keeps the lookup ticket (which pins the hit objects in the L1 arena)
until the workers have copied them, and tells the workers which newly computed prompt chunks to
store.

Loads are synchronous for one KV-cache group (the ticket is released once the step carrying the
load ran; failed chunks come back as invalid block ids). With several KV-cache groups, or recurrent
state, vLLM cannot take block-level failures, so hits are answered ``(n, True)``: vLLM parks the
request in ``WAITING_FOR_REMOTE_KVS`` until the workers report it in ``finished_recving`` (and in
``failed_recving`` if the load failed; vLLM then recomputes it from token 0 and this half answers
that retry with no hit). The ticket is kept until that report. Requests for which a store was scheduled are held (``request_finished`` returns True) until
the workers report them in ``finished_sending``.

With vLLM's ``--kv-events-config`` on, it also publishes which tiers hold the chunks and tails it
stored, as vLLM KV events (:mod:`tiercache.connector.events`; ``take_events``).

Recurrent (Mamba/GDN, ``mamba_cache_mode="align"``) groups: vLLM's block table for them is
position-indexed but sparse (null 0s) and entries move, so the block holding the state at a chunk
boundary is never resolved positionally. vLLM hands it over each step in
``scheduler_output.kv_connector_block_state.boundary_state_offloads`` (``(group, block, tokens)``
for the states that step computes); the state after chunk ``c`` is stored with chunk ``c``'s save.
On a hit of ``b`` chunks, vLLM assigns the state block at table position ``b * chunk / block - 1``
(as for its own prefix-cache hits), and the worker copies chunk ``b - 1``'s state object there.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tiercache.client.client import Client, LookupResult
from tiercache.client.link import LinkFactory, ServerLink
from tiercache.config.connector import ConnectorSettings
from tiercache.connector.blockmap import blocks_to_load, blocks_to_save, freed_blocks
from tiercache.connector.events import KVEventTracker
from tiercache.connector.feed import open_feed
from tiercache.connector.layout import (
    EngineLayout,
    cpu_in_step_checkpoints,
    derive_layout,
)
from tiercache.connector.metadata import (
    ChunkLoad,
    ChunkSave,
    RequestLoad,
    TierCacheMetadata,
)
from tiercache.connector.recurrent import check_recurrent_config
from tiercache.connector.stats import StatsRecorder, TierCacheConnectorStats
from tiercache.connector.tails import (
    askable_blocks,
    tail_block_size,
    tail_blocks,
    tail_holds,
    unsupported,
)
from tiercache.errors import TierCacheError
from tiercache.keys import ExtraKeys, ObjectKey, PrefixHasher, tail_hashes
from tiercache.keys.tenant import DEFAULT_TENANT, tenant_id
from tiercache.wire import protocol as p

log = logging.getLogger(__name__)

#: Backoff between polls of a ticket the server reports pending (a promotion, or a wait for another
#: engine's stores): the first poll soon, then doubling up to the cap.
_FIRST_POLL_DELAY_S = 0.001
_MAX_POLL_DELAY_S = 0.02


class LookupState(enum.Enum):
    NOT_SENT = "not_sent"
    WAITING_REPLY = "waiting_reply"  # lookup (or ticket poll) sent; reply not collected yet
    DONE = "done"  # ``hit_chunks`` is final (0 on a miss)


@dataclass(slots=True)
class _Probe:
    """One lookup in flight (the chunks', or a tail's) and the ticket pinning what it found."""

    pending_id: int = 0  # the async request id while its reply is outstanding (0: a ticket poll not sent yet)
    poll_after: float = 0.0  # monotonic time before which a pending ticket is not polled again
    poll_delay: float = 0.0  # the backoff between polls of a pending ticket
    sent_at: float = 0.0
    arena: str = ""  # the L1 arena its ticket's slots are in, as the reply that named them said
    awaited: bool = False  # a reply said the ticket waits for another engine's store (in flight)
    ticket: int = 0  # held while the hit objects must stay pinned
    per_tier: dict[str, int] = field(default_factory=dict)  # what it found, by tier (stats; first reply only)


@dataclass(slots=True)
class _TailLookup:
    """A request's tail (:mod:`tiercache.connector.tails`): the lookup of the blocks of the chunk
    after the full hit, what it found, and what of it was stored."""

    state: LookupState = LookupState.NOT_SENT
    chunk: int = -1  # the chunk whose blocks were asked for
    hashes: list[bytes] = field(default_factory=list)  # its blocks' tail hashes, asked for
    probe: _Probe = field(default_factory=lambda: _Probe())  # the lookup in flight
    blocks: int = 0  # blocks of ``chunk`` the cache can supply (pinned under the probe's ticket)
    target: bytes = b""  # the prefix hash of the object holding them (a tail, or the chunk)
    object_blocks: int = 0  # how many blocks that object holds (its first ``blocks`` load)
    slots: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # object group → pinned slot
    saved: tuple[int, int] = (-1, 0)  # (chunk, blocks of it stored, scheduled or found stored)


@dataclass(slots=True)
class _Request:
    """What the scheduler half tracks per request; dropped at ``request_finished``."""

    req_id: str
    prompt: list[int]
    extra: ExtraKeys
    tenant: bytes = DEFAULT_TENANT  # the cache salt's tenant id: whose quota its objects use
    hasher: PrefixHasher | None = None
    state: LookupState = LookupState.NOT_SENT
    probe: _Probe = field(default_factory=lambda: _Probe())  # the chunks' lookup in flight
    query_chunks: int = 0  # chunks the outstanding lookup asked about (stats)
    hit_chunks: int = 0
    server_chunks: int = 0  # the server's restorable prefix (chunks below need no store)
    slots: dict[int, dict[int, tuple[int, int, int]]] = field(default_factory=dict)  # chunk → group → slot
    local_tokens: int = 0  # the engine's own (block-aligned) hit at the last match
    block_ids: list[list[int]] = field(default_factory=list)
    saved_upto: int = -1  # chunks below are stored or scheduled for storing (-1: not decided yet)
    saves_scheduled: int = 0
    states: dict[int, dict[int, int]] = field(default_factory=dict)  # boundary chunk → kv group → block
    request: Any = None  # vLLM's Request (block hashes and extra keys for KV events)
    loading: bool = False  # an asynchronous load was sent; the ticket is kept until it is reported
    loaded_from_slots: bool = False  # that load named the ticket's slots (the workers pin nothing)
    load_failed: bool = False  # the workers reported its asynchronous load failed: compute instead
    tail: _TailLookup = field(default_factory=lambda: _TailLookup())

    def hashes(self, chunk_size: int) -> list[bytes]:
        if self.hasher is None or self.hasher.chunk_size != chunk_size:
            self.hasher = PrefixHasher(chunk_size, self.extra)
        return self.hasher.update(self.prompt)


def _extra_keys(request: Any) -> ExtraKeys:
    lora = getattr(request, "lora_request", None)
    return ExtraKeys(
        cache_salt=getattr(request, "cache_salt", None) or "",
        lora_name=(getattr(lora, "lora_name", None) or "") if lora is not None else "",
    )


class SchedulerHalf:
    """See the module docstring. Every method runs on the engine loop thread.

    ``link`` builds the connection to the server (a test passes a fake one); it is started here, and
    on every (re)connect the engine's layout is derived, checked and registered (:meth:`use_layout`).

    ``loads`` / ``stores`` follow vLLM's ``kv_role``: a producer (prefill engine) stores and never
    loads: its lookups only learn what the server already has, so nothing is stored twice; a
    consumer (decode engine) loads and never stores; ``kv_both`` does both.
    """

    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        settings: ConnectorSettings,
        *,
        link: LinkFactory = ServerLink,
        loads: bool = True,
        stores: bool = True,
    ) -> None:
        self._loads_enabled = loads
        self._stores_enabled = stores
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._settings = settings
        self.layout: EngineLayout | None = None
        self._refs: list[p.GroupRef] = []
        self._reqs: dict[str, _Request] = {}
        self._loads: list[RequestLoad] = []  # built by update_state_after_alloc, sent next meta
        self._step = 0
        self._lookup_wait_left = settings.lookup_wait_s  # this step's share left for lookup replies
        # step → tickets to release once it ran, each with whether a load copied from its slots
        self._release_at: dict[int, list[tuple[int, bool]]] = {}
        self._unfinished_steps: deque[int] = deque()
        self._orphans: list[int] = []  # async requests whose request is gone; collect and release
        self._saves_last_step = False  # (sliding layouts) stores were queued by the previous step
        self._async_loads = False  # set at connect: see _on_connect
        self._tail_block = 0  # > 0: tails are on (tiercache.connector.tails), in blocks of this many tokens
        self._prompt_tails = False  # also store a prompt's tail once computed, not only at its end
        self._end_saves: list[ChunkSave] = []  # stores planned when a request ended, sent next meta
        self.stats = StatsRecorder()
        self._outages_counted = 0
        # KV events for routers, when vLLM publishes them (--kv-events-config) or on a feed of our own.
        events_config = getattr(vllm_config, "kv_events_config", None)
        publishing = bool(getattr(events_config, "enable_kv_cache_events", False))
        block_size = getattr(kv_cache_config, "hash_block_size", None) or getattr(
            getattr(vllm_config, "cache_config", None), "block_size", 0
        )
        self.events = KVEventTracker(
            settings
            if publishing or settings.kv_events_endpoint
            else dataclasses.replace(settings, kv_events_interval_s=0.0),
            int(block_size or 0),
        )
        self.feed = open_feed(settings, vllm_config, self.events) if self.events.enabled else None
        self.link = link(settings, "vllm-scheduler", self._on_connect)
        self.link.start()

    # -- connection ----------------------------------------------------------------------------
    def _on_connect(self, client: Client) -> None:
        info = client.server
        layout = derive_layout(
            self._vllm_config, self._kv_cache_config, info.chunk_size, self._settings.weights_id
        )
        if len(layout.groups) > 1 and not info.separate_object_groups:
            from tiercache.errors import ConfigError

            raise ConfigError(
                f"this engine has {len(layout.groups)} object groups (KV-cache groups x parallel ranks) but "
                "the tiercache server runs with --no-separate-object-groups; restart it without that flag"
            )
        if layout.has_recurrent:
            self._check_recurrent(layout, info.separate_object_groups)
        self.use_layout(layout, client.register([(g.object_group, g.manifest) for g in layout.groups]))
        self.events.on_connect(client)
        log.info(
            "tiercache: scheduler registered %d object group(s), chunk %d tokens, fingerprint %s",
            len(layout.groups),
            layout.chunk_size,
            layout.groups[0].fingerprint.hex,
        )

    def use_layout(self, layout: EngineLayout, refs: list[p.GroupRef]) -> None:
        """Serve lookups and plan loads and stores for ``layout``, registered as ``refs``."""
        self._refs = refs
        # vLLM cannot map block-level load failures back to requests when there are several KV-cache
        # groups (it raises; Scheduler._handle_invalid_blocks): such layouts load asynchronously and
        # report a failure per request (failed_recving). Recurrent state always goes that way, so the
        # state lands before the request's first step (preprocess_mamba) and needs no zeroing tricks.
        self._async_loads = len(layout.kv_group_block_sizes()) > 1 or layout.has_recurrent
        self._tail_block = 0
        if self._settings.tails:
            why = unsupported(layout)
            if why is None:
                self._tail_block = tail_block_size(layout)
                # A request's tail is stored once: at its end (its prompt's and answer's blocks
                # in one object), or once its prompt is computed when the answer cannot add a
                # block (_tail_is_final); always at the prompt where the end is too late: a
                # producer's decode engine asks as soon as the prompt is done (reserved before the
                # response returns), and a sliding group's first blocks may have left the window.
                self._prompt_tails = not self._loads_enabled or layout.has_sliding
            else:  # (on by default: not a problem, whole chunks are what these layouts can use)
                log.info("tiercache: tails are off for this engine: %s", why)
        # A chunk's events follow one object of it: a full-attention group's exists for every
        # stored chunk (a sliding group's only inside the window, a recurrent one's at boundaries).
        if self.events.enabled:
            anchor = next(
                (g for g in layout.groups if not g.is_sliding and not g.is_recurrent), layout.groups[0]
            )
            self.events.use_anchor(anchor.fingerprint, anchor.object_group)
        self.layout = layout

    def _check_recurrent(self, layout: EngineLayout, separate_object_groups: bool) -> None:
        """Refuse an engine config under which recurrent state could never be stored or restored."""
        cache = self._vllm_config.cache_config
        for warning in check_recurrent_config(
            mamba_cache_mode=getattr(cache, "mamba_cache_mode", None),
            enable_prefix_caching=bool(getattr(cache, "enable_prefix_caching", False)),
            max_num_batched_tokens=int(self._vllm_config.scheduler_config.max_num_batched_tokens),
            block_size=layout.scheduler_block_size,
            chunk_size=layout.chunk_size,
            separate_object_groups=separate_object_groups,
            in_step_checkpoints_on_cpu=cpu_in_step_checkpoints(
                [g.kv_cache_spec for g in self._kv_cache_config.kv_cache_groups]
            ),
        ):
            log.warning("tiercache: %s", warning)
        if getattr(cache, "prefix_cache_retention_interval", None) == 0:
            # vLLM's default: states are kept (and so stored) only at each request's latest replay
            # boundary and at shared-prefix junctions, not at every chunk boundary.
            log.info(
                "tiercache: recurrent state is stored only where vLLM retains it; with "
                "--prefix-cache-retention-interval 0 (the default) that is each request's last "
                "prompt-block boundary. Set it to a multiple of %d to store periodic states.",
                layout.chunk_size,
            )

    def _client(self) -> Client | None:
        return self.link.client() if self.layout is not None else None

    # -- lookups -------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the cache can supply (``None``: not known yet)."""
        st = self._reqs.get(request.request_id)
        if st is None:
            prompt = request.prompt_token_ids
            extra = _extra_keys(request)
            st = _Request(
                request.request_id,
                list(prompt) if prompt is not None else [],
                extra,
                tenant_id(extra.cache_salt),
            )
            self._reqs[request.request_id] = st
        st.local_tokens = num_computed_tokens
        st.request = request
        if st.load_failed:
            # vLLM retries a request whose asynchronous load failed from its first token: compute it.
            return 0, False
        client = self._client()
        layout = self.layout
        if client is None or layout is None or not st.prompt:
            self._settle_miss(st)
            return 0, False
        chunk = layout.chunk_size
        limit = (len(st.prompt) - 1) // chunk  # always leave at least one token to compute
        sent = False
        if st.state is LookupState.NOT_SENT and limit * chunk <= num_computed_tokens:
            # The engine has every full chunk we could offer; what it has was stored when computed.
            self._settle_miss(st, server_chunks=num_computed_tokens // chunk)
            if not self._tail_block:
                return 0, False
        if st.state is LookupState.NOT_SENT:
            try:
                st.probe.pending_id = client.lookup_async(
                    st.hashes(chunk)[:limit],
                    self._refs,
                    prefetch=self._loads_enabled,  # a producer asks only how much is stored already
                    max_chunks=limit,
                    inflight_wait_s=self._settings.inflight_wait_s if self._loads_enabled else 0.0,
                    tenant=st.tenant,
                )
            except TierCacheError as exc:
                self.link.failed("lookup", exc)
                self._settle_miss(st)
                return 0, False
            st.state, st.probe.sent_at = LookupState.WAITING_REPLY, time.monotonic()
            sent = True
            st.query_chunks, st.probe.per_tier = limit, {}
        if st.state is LookupState.WAITING_REPLY and not self._collect(client, st, self._lookup_wait(sent)):
            return None, False  # "not known yet": vLLM skips the request this step and asks again
        if self._tail_block and self._loads_enabled and not self._tail_step(client, st, num_computed_tokens):
            return None, False
        hit_tokens = self._hit_tokens(st, num_computed_tokens)
        if hit_tokens <= num_computed_tokens:
            self._drop_ticket(st)
            return 0, False
        # True: vLLM allocates the blocks, parks the request in WAITING_FOR_REMOTE_KVS and waits for
        # the workers' finished_recving (see update_state_after_alloc, update_connector_output).
        return hit_tokens - num_computed_tokens, self._async_loads

    def _lookup_wait(self, sent: bool) -> float:
        """How long to wait for the reply of a lookup just ``sent``: it usually comes within a
        millisecond, and waiting that long lets vLLM schedule the request in this step instead of
        the next. The waits of one step share ``lookup_wait_s``, so a slow server costs a step at
        most that, however many requests arrive in it."""
        if not sent or self._lookup_wait_left <= 0:
            return 0.0
        return self._lookup_wait_left

    def _hit_tokens(self, st: _Request, num_computed_tokens: int) -> int:
        """Where the hit ends: after the full chunks found, or after the tail blocks found in the
        chunk that follows what the engine and the cache hold together."""
        assert self.layout is not None
        chunk = self.layout.chunk_size
        full = st.hit_chunks * chunk
        if not st.tail.blocks or st.tail.chunk * chunk > max(full, num_computed_tokens):
            return full  # (the tail does not join on: vLLM's own hit changed since it was asked)
        return st.tail.chunk * chunk + st.tail.blocks * self._tail_block

    def _tail_step(self, client: Client, st: _Request, num_computed_tokens: int) -> bool:
        """Ask for the blocks of the chunk after the full hit (once), or collect the reply; True
        once ``st.tail.blocks`` is final."""
        if st.tail.state is LookupState.DONE:
            return True
        sent = False
        if st.tail.state is LookupState.NOT_SENT:
            assert self.layout is not None
            chunk, block = self.layout.chunk_size, self._tail_block
            at = max(st.hit_chunks, num_computed_tokens // chunk)
            asked = askable_blocks(len(st.prompt), at, chunk, block)
            if asked == 0 or at * chunk + asked * block <= num_computed_tokens:
                st.tail.state = LookupState.DONE
                return True
            st.hashes(chunk)  # the chain up to ``at`` (the hasher has consumed every full chunk)
            assert st.hasher is not None
            st.tail.hashes = tail_hashes(
                st.hasher.before(at), st.prompt[at * chunk : at * chunk + asked * block], block
            )
            try:
                st.tail.probe.pending_id = client.lookup_async(
                    st.tail.hashes,
                    self._refs,
                    max_chunks=asked,
                    inflight_wait_s=self._settings.inflight_wait_s,
                    tenant=st.tenant,
                    kind=p.LookupKind.TAIL,
                )
            except TierCacheError as exc:
                self.link.failed("lookup", exc)
                st.tail.state = LookupState.DONE
                return True
            st.tail.state, st.tail.chunk, st.tail.probe.sent_at = (
                LookupState.WAITING_REPLY,
                at,
                time.monotonic(),
            )
            sent = True
        return self._collect_tail(client, st, self._lookup_wait(sent))

    def _advance(self, client: Client, probe: _Probe, wait_s: float) -> LookupResult | None:
        """One step of a lookup in flight, waiting up to ``wait_s`` for a reply: the reply once it is
        final, ``None`` while it is not. A ticket the server reports pending (a promotion, or a
        wait for another engine's store) is polled again after a backoff; once it is too late the
        pending reply is returned (the caller gives up). Raises :class:`TierCacheError`."""
        if probe.pending_id == 0:  # a pending ticket between polls (see below)
            if time.monotonic() < probe.poll_after:
                return None
            probe.pending_id = client.poll_ticket_async(probe.ticket)
        # The client raises ServerUnavailableError once the reply is timeout_s late.
        began = time.monotonic()
        result: LookupResult | None = client.poll(probe.pending_id, wait_s)
        if wait_s:
            self._lookup_wait_left -= time.monotonic() - began
        if result is None:
            return None
        if result.ticket:
            probe.ticket = result.ticket
        if result.per_tier:  # kept: ticket polls do not repeat them, and a pending reply returns None
            probe.per_tier = dict(result.per_tier)
        if result.state is not p.TicketStateName.PENDING:
            # Taken from this very reply: the client says hello again by itself when the server
            # restarts, so whatever it holds at connect may name an arena these slots are not in.
            probe.arena = result.arena
            return result
        # A promotion gets timeout_s, like any round trip; a wait for another engine's store is the
        # server's to bound (inflight_wait_s), so it gets that on top.
        probe.awaited = probe.awaited or result.awaiting > 0
        bound = self._settings.timeout_s + (self._settings.inflight_wait_s if probe.awaited else 0.0)
        if time.monotonic() - probe.sent_at > bound:
            return result
        # Poll again after a backoff (1 ms, doubling to 20 ms): vLLM asks every step, and an
        # in-flight wait can last seconds (a poll per step was measured at ~900/s).
        probe.poll_delay = (
            min(2 * probe.poll_delay, _MAX_POLL_DELAY_S) if probe.poll_delay else _FIRST_POLL_DELAY_S
        )
        probe.poll_after = time.monotonic() + probe.poll_delay
        probe.pending_id = 0
        return None

    def _collect_tail(self, client: Client, st: _Request, wait_s: float) -> bool:
        """Advance the tail lookup as :meth:`_collect` does the chunks'; True once it is settled."""
        try:
            result = self._advance(client, st.tail.probe, wait_s)
        except TierCacheError as exc:
            self.link.failed("lookup", exc)
            st.tail.probe.ticket = 0  # a server that failed us holds no usable pins for us
            self._drop_tail(st)
            st.tail.state = LookupState.DONE
            return True
        if result is None:
            return False
        st.tail.state = LookupState.DONE
        # (Still pending here means too late: given up, as the chunks' lookup does.)
        if result.state is not p.TicketStateName.READY or not result.ready_chunks or self.layout is None:
            self._drop_tail(st)
            return True
        # One object holds the blocks found, at its first positions: a tail, or the chunk itself
        # (found through the server's block index). Every group's object of it is pinned (a
        # sliding group's too: the tail is the newest part of its window), all of one size in
        # blocks, holding at least the blocks the reply counts.
        blocks = min(result.blocks, len(st.tail.hashes))
        by_group = {}
        for slot in result.slots:
            group, prefix_hash = ObjectKey.group_and_hash(slot.key)
            by_group[group] = (prefix_hash, slot.nbytes)
            st.tail.slots[group] = (slot.offset, slot.nbytes, slot.digest)
        targets = {h for h, _ in by_group.values()}
        sizes = set()
        for g in self.layout.groups:
            held = by_group.get(g.object_group)
            per_block = len(g.layer_names) * g.page_bytes
            if held is None or not per_block or held[1] % per_block:
                sizes.add(-1)
            else:
                sizes.add(held[1] // per_block)
        object_blocks = sizes.pop() if len(sizes) == 1 else -1
        if len(targets) != 1 or not blocks <= object_blocks <= self.layout.chunk_size // self._tail_block:
            blocks = 0
        st.tail.blocks = blocks
        st.tail.saved = (st.tail.chunk, blocks)  # the server holds these: never stored again
        if blocks == 0:
            self._drop_tail(st)
        else:
            st.tail.target, st.tail.object_blocks = targets.pop(), object_blocks
            self.stats.add("hit_tokens", blocks * self._tail_block)
        return True

    def _drop_tail(self, st: _Request, read: bool = False) -> None:
        """Release the tail lookup's ticket after the step being built now has run (``read``: the
        step loads from its slots)."""
        if st.tail.probe.ticket:
            self._release_at.setdefault(self._step + 1, []).append((st.tail.probe.ticket, read))
            st.tail.probe.ticket = 0
        st.tail.blocks, st.tail.slots = 0, {}

    def _settle_miss(self, st: _Request, server_chunks: int = 0) -> None:
        st.state, st.hit_chunks = LookupState.DONE, 0
        if st.saved_upto < 0:
            st.saved_upto = server_chunks

    def _collect(self, client: Client, st: _Request, wait_s: float = 0.0) -> bool:
        """Advance an outstanding lookup, waiting up to ``wait_s`` for its first reply; True once
        ``hit_chunks`` is final."""
        try:
            result = self._advance(client, st.probe, wait_s)
        except TierCacheError as exc:
            self.link.failed("lookup", exc)
            st.probe.ticket = 0  # a server that failed us holds no usable pins for us
            self._settle_miss(st)
            self._record_lookup(st)
            return True
        if result is None:
            return False
        if result.state is p.TicketStateName.PENDING:  # still pending, too late
            what = "wait for another engine's store" if st.probe.awaited else "promotion"
            log.info("tiercache: %s for %s too slow; computing instead", what, st.req_id)
            self._drop_ticket(st)
            self._settle_miss(st)
            self._record_lookup(st)
            return True
        if st.saved_upto < 0:
            st.saved_upto = result.chunks if result.chunks else 0
        st.state = LookupState.DONE
        if result.state is not p.TicketStateName.READY or not result.ready_chunks:
            self._drop_ticket(st)
            st.hit_chunks = 0
            self._record_lookup(st)
            return True
        index = {h: i for i, h in enumerate(st.hashes(self.layout.chunk_size))} if self.layout else {}
        slots: dict[int, dict[int, tuple[int, int, int]]] = {}
        for slot in result.slots:
            group, prefix_hash = ObjectKey.group_and_hash(slot.key)
            i = index.get(prefix_hash)
            if i is not None:
                slots.setdefault(i, {})[group] = (slot.offset, slot.nbytes, slot.digest)
        hit = self._restorable(slots, result.ready_chunks)
        st.hit_chunks, st.slots = hit, slots
        if hit == 0:
            self._drop_ticket(st)
        self._record_lookup(st)
        return True

    def _record_lookup(self, st: _Request) -> None:
        """Count a settled lookup: what it asked about and what the cache can supply."""
        chunk = self.layout.chunk_size if self.layout is not None else 0
        self.stats.add("lookups")
        self.stats.add("query_tokens", st.query_chunks * chunk)
        if st.hit_chunks:
            self.stats.add("hit_chunks", st.hit_chunks)
            self.stats.add("hit_tokens", st.hit_chunks * chunk)
            self.stats.add_tiers(st.probe.per_tier)

    def take_stats(self) -> TierCacheConnectorStats | None:
        """Lookups since the last call, and server outages this half noticed."""
        outages = self.link.outages
        if outages != self._outages_counted:
            self.stats.add("server_unavailable", outages - self._outages_counted)
            self._outages_counted = outages
        return self.stats.take()

    def _restorable(self, slots: dict[int, dict[int, tuple[int, int, int]]], ready: int) -> int:
        """The longest boundary ``<= ready`` whose needed objects (every chunk of a full-attention
        group, the trailing window chunks of a sliding one) are all pinned for us."""
        layout = self.layout
        if layout is None:
            return 0
        for boundary in range(ready, 0, -1):
            if all(
                g.object_group in slots.get(c, {})
                for g in layout.groups
                for c in g.needed_chunks(boundary, layout.chunk_size)
            ):
                return boundary
        return 0

    def _drop_ticket(self, st: _Request, read: bool = False) -> None:
        """Release the request's ticket after the step being built now has run (never earlier:
        a worker may still be copying from its slots). ``read``: that step's load copies from the
        tickets' slots (the server counts their objects as L1 reads)."""
        if st.probe.ticket:
            self._release_at.setdefault(self._step + 1, []).append((st.probe.ticket, read))
            st.probe.ticket = 0
        st.slots = {}
        st.hit_chunks = 0
        self._drop_tail(st, read)

    # -- allocation and metadata ---------------------------------------------------------------
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or self.layout is None:
            return
        if num_external_tokens <= 0:
            self._drop_ticket(st)
            return
        # One block list per KV-cache group, each in that group's own block size (their lengths
        # differ when the block sizes do, e.g. Gemma 4: ``([1, 2], [3, 4, 5, 6])``).
        block_ids = [list(ids) for ids in blocks.get_block_ids()]
        start, end = st.local_tokens, st.local_tokens + num_external_tokens
        hashes = st.hashes(self.layout.chunk_size)
        sizes = self.layout.kv_group_block_sizes()
        recurrent = self.layout.recurrent_kv_groups()
        # A sliding-window group's blocks before the window are vLLM's null block (0): the worker
        # skips those positions (and the group, for chunks wholly outside the window). A chunk
        # whose blocks are not all allocated ends the list: load less, never garbage.
        chunk = self.layout.chunk_size
        # Whole chunks up to the full hit's end; the tail's blocks (if the hit ends in one) after.
        full_end = min(end, st.hit_chunks * chunk) if st.tail.blocks else end
        planned = (
            blocks_to_load(block_ids, sizes, chunk, start, full_end, skip=recurrent)
            if full_end > start
            else []
        )
        chunks = [
            ChunkLoad(
                hashes[cb.chunk],
                [list(p) for p in cb.positions],
                [list(i) for i in cb.block_ids],
                slots=[(g, *at) for g, at in st.slots.get(cb.chunk, {}).items()],
            )
            for cb in planned
        ]
        complete = full_end <= start or (bool(planned) and planned[-1].chunk == -(-full_end // chunk) - 1)
        if end > full_end:
            base = st.tail.chunk * chunk
            first, upto = -(-(max(start, base) - base) // self._tail_block), (end - base) // self._tail_block
            tails = tail_blocks(
                block_ids,
                st.tail.chunk,
                chunk,
                self._tail_block,
                st.tail.hashes,
                first,
                upto,
                store=False,
                sliding=self.layout.kv_group_windows().keys(),
            )
            if tails:  # one object holds them all, block j at its position j
                chunks.append(
                    ChunkLoad(
                        st.tail.target,
                        [[t.j for t in tails if t.block_ids[g]] for g in range(len(block_ids))],
                        [[t.block_ids[g][0] for t in tails if t.block_ids[g]] for g in range(len(block_ids))],
                        blocks=st.tail.object_blocks,
                        slots=[(g, *at) for g, at in st.tail.slots.items()],
                    )
                )
            complete = complete and len(tails) == upto - first
        if recurrent and complete:
            # The state at the boundary goes where vLLM put it for a hit of ``end`` tokens; a null
            # (0) here makes the worker fail the load, so vLLM recomputes.
            last = chunks[-1]
            last.state = True
            for kv in recurrent:
                at = end // sizes[kv] - 1
                last.block_ids[kv] = [block_ids[kv][at] if at < len(block_ids[kv]) else 0]
                last.positions[kv] = [0]
        # Where the ticket pinned them, so the workers need not pin again: the lookups' send is
        # before any of their leases started (RequestLoad.leased_at).
        probes = [pr for pr in (st.probe, st.tail.probe) if pr.ticket and pr.sent_at]
        arenas = {pr.arena for pr in probes}
        arena = arenas.pop() if len(arenas) == 1 else ""  # two servers' slots: the workers pin by key
        named = bool(probes and arena and chunks and all(c.slots for c in chunks))
        leased_at = min(pr.sent_at for pr in probes) if named else 0.0
        if self._async_loads:
            # vLLM counts all ``num_external_tokens`` as computed once the load is reported: a load
            # that cannot place every chunk is reported failed by the workers (``complete``).
            self._loads.append(
                RequestLoad(
                    st.req_id, chunks, asynchronous=True, complete=complete, leased_at=leased_at, arena=arena
                )
            )
            st.loading, st.loaded_from_slots = True, bool(leased_at)
            # the ticket stays until the workers report the load (update_connector_output)
            # A request loading anew was preempted (or is new): its earlier stores were flushed at
            # the preemption and the workers forget them on this load. Finished while loading, it
            # must not be held for finished_sending too: vLLM frees it on finished_recving, and a
            # second report for a freed request fails its assertion.
            st.saves_scheduled = 0
        else:
            self._loads.append(RequestLoad(st.req_id, chunks, leased_at=leased_at, arena=arena))
            self._drop_ticket(st, read=bool(leased_at))  # released once the step carrying these loads has run
        st.saved_upto = max(st.saved_upto, end // self.layout.chunk_size)

    def build_connector_meta(self, scheduler_output: Any) -> TierCacheMetadata:
        self._lookup_wait_left = self._settings.lookup_wait_s  # a new step: a new budget (_lookup_wait)
        self._step += 1
        self._unfinished_steps.append(self._step)
        meta = TierCacheMetadata(step=self._step, loads=self._loads, saves=self._end_saves)
        self._loads, self._end_saves = [], []
        # Sliding-window groups free blocks that fall out of the window while the request runs, and
        # vLLM may hand them to another request in the very next step: with such groups every store
        # queued in the previous step is finished before the next forward pass can rewrite a block.
        meta.flush = bool(getattr(scheduler_output, "preempted_req_ids", None)) or self._saves_last_step
        self._saves_last_step = False
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            st = self._reqs.get(rid)
            if st is not None:  # it will be matched again when it is rescheduled
                self._drop_ticket(st)
                st.state, st.hit_chunks, st.load_failed = LookupState.NOT_SENT, 0, False
                st.tail.state = LookupState.NOT_SENT
                st.states.clear()  # its blocks are freed: offers made before are void
        self._take_boundary_states(scheduler_output)
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = [list(ids) for ids in new.block_ids]
            self._plan_saves(st, new.num_computed_tokens, num_scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = [list(ids) for ids in new_ids] if new_ids is not None else st.block_ids
            elif new_ids is not None:
                for g, ids in enumerate(new_ids):
                    st.block_ids[g].extend(ids)
            self._plan_saves(st, cached.num_computed_tokens[i], num_scheduled.get(rid, 0), meta)
        # Recurrent state blocks are freed as the request moves on (the block holding the state
        # after step N is freed when step N+2 is scheduled): the same early flush protects them.
        if meta.saves and self.layout is not None and (self.layout.has_sliding or self.layout.has_recurrent):
            self._saves_last_step = True
        self._collect_orphans()
        return meta

    def _take_boundary_states(self, scheduler_output: Any) -> None:
        """Record the blocks vLLM hands over holding recurrent state at chunk boundaries."""
        layout = self.layout
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(block_state, "boundary_state_offloads", None)
        if layout is None or not offers:
            return
        recurrent = layout.recurrent_kv_groups()
        for req_id, entries in offers.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            for kv, block, tokens in entries:
                # Only whole-chunk boundaries inside the prompt (stores cover prompt chunks only).
                if (
                    kv in recurrent
                    and block
                    and tokens % layout.chunk_size == 0
                    and 0 < tokens <= len(st.prompt)
                ):
                    st.states.setdefault(tokens // layout.chunk_size, {})[kv] = block

    def _plan_saves(self, st: _Request, before: int, scheduled: int, meta: TierCacheMetadata) -> None:
        """Schedule stores for the prompt chunks that are complete once this step has run
        (``before``: tokens computed before this step, ``scheduled``: tokens it computes), and with
        tails on for a producer or a sliding-window model, for the full blocks of the prompt's last
        partial chunk once they are (others store a request's tail at its end only)."""
        computed = min(before + scheduled, len(st.prompt))
        tails = (
            self._tail_block > 0
            and computed == len(st.prompt)
            and (self._prompt_tails or self._tail_is_final(st))
        )
        self._plan_saves_upto(st, computed, before, meta.saves, tails=tails)

    def _tail_is_final(self, st: _Request) -> bool:
        """Whether the request's end cannot add a full block to its prompt's tail (its answer
        ends inside the prompt's last block: ``max_tokens`` says so): then the tail is stored as
        soon as the prompt is computed, the very object its end would store, and not lost if no
        step follows the request's end (an offline ``LLM.generate`` call's last request)."""
        max_tokens = getattr(st.request, "max_tokens", None)
        if not isinstance(max_tokens, int):
            return True  # unknown: store now
        block, n = self._tail_block, len(st.prompt)
        return (n + max_tokens - 1) // block == n // block  # the last token's KV never exists

    def _plan_saves_upto(
        self, st: _Request, computed: int, before: int, saves: list[ChunkSave], *, tails: bool
    ) -> None:
        """Stores for ``st.prompt``'s tokens below ``computed`` not stored yet (``before``: tokens
        computed before this step, for the sliding window's freed blocks); with ``tails`` (the
        prompt or the request is done: never mid-prefill, where the next step fills the chunk),
        also the full blocks of the chunk ``computed`` ends in."""
        layout = self.layout
        if not self._stores_enabled or layout is None or not st.prompt or self.link.client() is None:
            return
        chunk = layout.chunk_size
        end = computed // chunk
        first = max(st.saved_upto, 0)
        if self._tail_block and tails and end <= first:
            self._plan_tail_saves(st, computed, before, saves)
            return
        if end <= first:
            return
        hashes = st.hashes(chunk)
        # Blocks of a sliding group that vLLM may already have freed are never read: such a group
        # gets 0s for the chunk (no object); each group maps chunks with its own block size.
        recurrent = layout.recurrent_kv_groups()
        planned = blocks_to_save(
            st.block_ids,
            layout.kv_group_block_sizes(),
            layout.kv_group_windows(),
            chunk,
            first,
            end,
            before,
            skip=recurrent,
        )
        for c, ids in planned:
            # The state after chunk c, if vLLM kept one at that boundary ([0]: no object).
            state = st.states.pop(c + 1, {})
            for kv in recurrent:
                ids[kv] = [state.get(kv, 0)]
            save = ChunkSave(st.req_id, c, hashes[c], ids, st.tenant)
            if self._tail_block and all(all(x) for kv, x in enumerate(ids) if kv not in recurrent):
                # Every group's object is stored: the chunk holds every tail of it, and a tail
                # lookup finds its blocks in it.
                save.supersedes = self._chunk_tails(st, c)
                save.holds = save.supersedes
            saves.append(save)
            self.events.remember(st.request, c, chunk, hashes[c])
            st.saves_scheduled += 1
            st.saved_upto = c + 1
        if self._tail_block and tails and st.saved_upto == end:
            self._plan_tail_saves(st, computed, before, saves)

    def _chunk_tails(self, st: _Request, c: int) -> list[bytes]:
        """The tail hashes of chunk ``c``'s blocks short of its end: the keys of the tails storing
        it supersedes, and the blocks a tail lookup finds in it."""
        assert self.layout is not None and st.hasher is not None
        chunk, block = self.layout.chunk_size, self._tail_block
        return tail_hashes(st.hasher.before(c), st.prompt[c * chunk : (c + 1) * chunk - block], block)

    def _plan_tail_saves(self, st: _Request, computed: int, before: int, saves: list[ChunkSave]) -> None:
        """The store of the full blocks below ``computed`` of the chunk it ends in, once every
        chunk before is stored or scheduled: one object (per group) of the chunk's first ``k``
        blocks, keyed by the tail hash of its last, holding every block from the chunk's first
        (lookups ask from there) and superseding the shorter tails of the chunk. Nothing when the
        server already holds that many of them (stored by this request, or found).

        A sliding group's first blocks may already be freed (out of the window: a request's end,
        after its decode moved on): the object holds zeros there, it names for the block index
        only the blocks whose hit needs none of them (:func:`tail_holds`), and it supersedes
        nothing (a shorter tail still serves the shorter hits)."""
        layout = self.layout
        assert layout is not None
        chunk, block = layout.chunk_size, self._tail_block
        c = computed // chunk
        if st.saved_upto != c:
            return
        stored = st.tail.saved[1] if st.tail.saved[0] == c else 0
        last = min((computed - c * chunk) // block, chunk // block - 1)
        if last <= stored:
            return
        st.hashes(chunk)
        assert st.hasher is not None
        hashes = tail_hashes(st.hasher.before(c), st.prompt[c * chunk : c * chunk + last * block], block)
        tails = tail_blocks(st.block_ids, c, chunk, block, hashes, 0, last, store=True)
        k = len(tails)
        if k <= stored:
            return
        recurrent = layout.recurrent_kv_groups()
        windows = layout.kv_group_windows()
        # Per sliding group, its blocks of this chunk vLLM may have freed (a prefix of them).
        gone = {
            kv: min(k, max(0, freed_blocks(before, w, block) - c * (chunk // block)))
            for kv, w in windows.items()
        }
        ids = [
            []
            if kv in recurrent
            else [0 if j < gone.get(kv, 0) else t.block_ids[kv][0] for j, t in enumerate(tails)]
            for kv in range(len(st.block_ids))
        ]
        held = hashes[:k]
        if st.tail.chunk == c and st.tail.target == held[-1]:
            st.tail.saved = (c, k)  # the lookup found this very object (a replay): stored already
            return
        holds = tail_holds(held, c, chunk, block, windows, gone)
        if not holds:
            return  # no hit could use it
        covers = held[:-1] if not any(gone.values()) else []
        saves.append(
            ChunkSave(st.req_id, c, held[-1], ids, st.tenant, blocks=k, supersedes=covers, holds=holds)
        )
        self.events.remember_tail(st.request, c, chunk, 0, k * block, held[-1])
        st.saves_scheduled += 1
        st.tail.saved = (c, k)

    def _collect_orphans(self) -> None:
        client = self.link.client()
        if client is None or not self._orphans:
            return
        keep = []
        for req_id in self._orphans:
            try:
                result = client.poll(req_id)
            except TierCacheError:
                continue
            if result is None:
                keep.append(req_id)
            elif result.ticket:
                self._release_at.setdefault(self._step + 1, []).append((result.ticket, False))
        self._orphans = keep

    # -- step results and request end ---------------------------------------------------------
    def update_connector_output(self, connector_output: Any) -> None:
        """A step has run: release the tickets whose loads it carried, and those of the asynchronous
        loads the workers reported (``finished_recving``; failed ones are also in ``failed_recving``)."""
        tickets: list[tuple[int, bool]] = []
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        for rid in getattr(connector_output, "finished_recving", None) or ():
            st = self._reqs.get(rid)
            if st is None or not st.loading:
                continue  # finished while loading: request_finished already scheduled the release
            st.loading = False
            read = st.loaded_from_slots and rid not in failed
            tickets.extend(
                (t, read) for t in (st.probe.ticket, st.tail.probe.ticket) if t
            )  # every worker is done copying
            st.probe.ticket, st.slots, st.hit_chunks = 0, {}, 0
            st.tail.probe.ticket, st.tail.blocks, st.tail.slots = 0, 0, {}
            # On a failure vLLM frees the blocks and schedules the request again from its first
            # token (Scheduler._handle_failed_recving): that retry computes instead of loading.
            st.load_failed = rid in failed
        if self._unfinished_steps:
            done = self._unfinished_steps.popleft()
            for step in [s for s in self._release_at if s <= done]:
                tickets.extend(self._release_at.pop(step))
        if not tickets:
            return
        client = self.link.client()
        if client is None:
            return  # the server forgot them (restart) or leases expire by themselves
        for ticket, read in tickets:
            try:
                client.release_ticket(ticket, read=read)
            except TierCacheError as exc:
                if getattr(exc, "code", "") != "unknown_token":
                    self.link.failed("release of a lookup ticket", exc)
                    return

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks (True) iff stores were scheduled for the request: the workers then
        report it in ``finished_sending`` once those stores are done."""
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        if st.state is LookupState.WAITING_REPLY and st.probe.pending_id:
            self._orphans.append(st.probe.pending_id)
        if st.tail.state is LookupState.WAITING_REPLY and st.tail.probe.pending_id:
            self._orphans.append(st.tail.probe.pending_id)
        if self._tail_block:
            self._plan_end_saves(st, request)
        # Also while its asynchronous load is in flight (vLLM holds the blocks until the workers
        # report it): released after the next step, which runs after the step carrying the load.
        self._drop_ticket(st)
        return st.saves_scheduled > 0, None

    def _plan_end_saves(self, st: _Request, request: Any) -> None:
        """With tails on, a finished request's generated tokens are stored too (their full chunks,
        then the full blocks of the last one), so the next turn of a chat finds its whole history.
        They go out with the next step's metadata; vLLM holds the blocks until they are stored."""
        tokens = getattr(request, "all_token_ids", None)
        if tokens is None or not st.prompt or st.tail.state is LookupState.WAITING_REPLY:
            return
        # The last sampled token has no KV yet; the KV of every token before it was computed.
        computed = min(int(getattr(request, "num_computed_tokens", 0)), len(tokens) - 1)
        if computed <= 0:
            return
        if len(tokens) > len(st.prompt):
            st.prompt = list(tokens)
        self._plan_saves_upto(st, computed, computed, self._end_saves, tails=True)

    def has_pending_events(self) -> bool:
        """Whether stored chunks still wait for their first event (vLLM keeps stepping meanwhile)."""
        return self.events.busy()

    def take_events(self) -> list[Any]:
        """KV events (vLLM's ``BlockStored`` / ``BlockRemoved``) for the tiers that gained or lost
        chunks and tails this engine stored, since the last call (see :mod:`tiercache.connector.events`)."""
        return self.events.take(self._client())

    def shutdown(self) -> None:
        self.link.close()
        if self.feed is not None:
            self.feed.close()
