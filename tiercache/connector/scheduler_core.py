"""The scheduler half's state (:class:`SchedulerCore`): every field of
:class:`~tiercache.connector.scheduler.SchedulerHalf`, one object and one set of fields; what it
tracks per request (:class:`_Request`, its lookups' :class:`_Probe`, its tail's :class:`_TailLookup`);
the layout it serves, derived, checked and registered on every connect; and the release of a
request's tickets. The layers above it add the behaviour:
:class:`~tiercache.connector.scheduler_lookups.SchedulerLookups` (lookups of chunks and tails),
:class:`~tiercache.connector.scheduler_saves.SchedulerSaves` (which chunks and tails to store) and
:class:`~tiercache.connector.scheduler.SchedulerHalf` (loads, the step's metadata and results); see
:mod:`tiercache.connector.scheduler` for what the scheduler half does.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tiercache.client.client import Client
from tiercache.client.link import LinkFactory, ServerLink
from tiercache.config.connector import ConnectorSettings
from tiercache.connector.events import KVEventTracker
from tiercache.connector.feed import open_feed
from tiercache.connector.layout import EngineLayout, cpu_in_step_checkpoints, derive_layout
from tiercache.connector.metadata import ChunkSave, RequestLoad
from tiercache.connector.recurrent import check_recurrent_config
from tiercache.connector.stats import StatsRecorder
from tiercache.connector.tails import tail_block_size, unsupported
from tiercache.keys import ExtraKeys, PrefixHasher
from tiercache.keys.tenant import DEFAULT_TENANT
from tiercache.wire import protocol as p

log = logging.getLogger(__name__)


class LookupState(enum.Enum):
    """Where a lookup (a request's chunks', or its tail's) stands."""

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
    polled_at: float = 0.0  # when the last poll of its pending ticket was sent
    promised: int = 0  # the chunks a pending reply said its ticket promotes (0: none came yet)
    sent_step: int = 0  # the scheduler steps built when it was sent (SchedulerCore._step)
    timed: bool = False  # its wait until the scheduler could answer vLLM was recorded
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
    early: bool = False  # asked while the chunks' lookup was pending, at the hit it promised


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


class SchedulerCore:
    """The scheduler half's fields, layout and request state (module docstring); abstract:
    :class:`~tiercache.connector.scheduler.SchedulerHalf` is the class to build.

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
        self._releases_held = False  # the client holds releases back for the next lookup
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

    # -- request state -------------------------------------------------------------------------
    def _settle_miss(self, st: _Request, server_chunks: int = 0) -> None:
        st.state, st.hit_chunks = LookupState.DONE, 0
        if st.saved_upto < 0:
            st.saved_upto = server_chunks

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

    def _drop_tail(self, st: _Request, read: bool = False) -> None:
        """Release the tail lookup's ticket after the step being built now has run (``read``: the
        step loads from its slots)."""
        if st.tail.probe.ticket:
            self._release_at.setdefault(self._step + 1, []).append((st.tail.probe.ticket, read))
            st.tail.probe.ticket = 0
        st.tail.blocks, st.tail.slots = 0, {}
