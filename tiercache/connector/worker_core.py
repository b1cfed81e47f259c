"""The worker half's state (:class:`WorkerCore`): every field of
:class:`~tiercache.connector.worker.WorkerHalf`, one object and one set of fields, and the layout
it loads and stores (derived, checked against the KV tensors and registered on every connect).
The layers above it add the behaviour: :class:`~tiercache.connector.worker_loads.WorkerLoads` (a
step's loads), :class:`~tiercache.connector.worker_saves.WorkerSaves` (the save thread) and
:class:`~tiercache.connector.worker.WorkerHalf` (start-up, the step's first hook and results); see
:mod:`tiercache.connector.worker` for what the worker half does.
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tiercache.client.affinity import spread_current_thread
from tiercache.client.client import Client
from tiercache.client.link import LinkFactory, ServerLink
from tiercache.client.transfer import Load, SlotCheck
from tiercache.config.connector import ConnectorSettings
from tiercache.connector.copy import PageCopyEngine
from tiercache.connector.layout import EngineLayout, GroupLayout, derive_layout, verify_kv_caches
from tiercache.connector.loads import LoadJob, forward_order
from tiercache.connector.metadata import TierCacheMetadata
from tiercache.connector.pages import PageView
from tiercache.connector.stats import StatsRecorder
from tiercache.errors import ConfigError
from tiercache.keys import Fingerprint


@dataclass(eq=False)
class _StepLoad:
    """One step's loads from start to report (see
    :meth:`~tiercache.connector.worker_loads.WorkerLoads.start_load_kv`)."""

    meta: TierCacheMetadata
    owner: list[int]  # chunk → index of its request in ``meta.loads``
    started: float
    #: The slots copied from (the scheduler's ticket's, adopted, or pinned here), or ``None``.
    transfer: Load | None = None
    ticket_slots: bool = False  # copied from the scheduler's ticket's slots: no pin, no release
    chunk_objects: dict[int, range] = field(default_factory=dict)  # per chunk: its slots' indexes
    checks: dict[int, SlotCheck] = field(default_factory=dict)  # per planned slot: its copy's check
    #: The slots whose copy failed its check, worked out by the check thread during the forward pass.
    verdict: Future[list[int]] | None = None
    planned: list[bool] = field(default_factory=list)  # per chunk: its writes are in the job
    nbytes: dict[int, int] = field(default_factory=dict)  # per planned chunk: bytes it loads
    job: LoadJob | None = None

    @property
    def sync(self) -> bool:
        """Whether it feeds this very step's forward pass (some request's load is synchronous)."""
        return not all(r.asynchronous for r in self.meta.loads)


class WorkerCore:
    """The worker half's fields and layout (module docstring); abstract:
    :class:`~tiercache.connector.worker.WorkerHalf` is the class to build."""

    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        settings: ConnectorSettings,
        *,
        link: LinkFactory = ServerLink,
        reserve_before_return: bool = False,
    ) -> None:
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._settings = settings
        self._reserve_before_return = reserve_before_return  # a producer's (see the module docstring)
        self._rank = 0
        self._groups: list[GroupLayout] = []
        self._fingerprints: dict[int, Fingerprint] = {}
        self._pages: dict[int, list[PageView]] = {}  # kv group → per-layer page views
        self._copy: PageCopyEngine | None = None
        self._kv_caches: dict[str, torch.Tensor] | None = None
        self._lock = threading.Lock()  # guards _pending, _with_saves, _load_errors
        self._idle = threading.Condition(self._lock)
        self._pending: dict[str, int] = defaultdict(int)  # req → queued saves not finished
        self._with_saves: set[str] = set()  # reqs that had saves: report each once finished
        self._finished_waiting: set[str] = set()
        self._load_errors: set[int] = set()
        self._recv_done: set[str] = set()  # asynchronous loads done this step (reported once)
        self._recv_failed: set[str] = set()  # ... of which some chunk failed
        self._loaded_step = -1  # the step whose loads started (handle_preemptions or start_load_kv)
        self._loads: list[_StepLoad] = []  # started, not yet reported (model-runner thread only)
        self._sync_load: _StepLoad | None = None  # this step's load the forward pass waits for
        self._layer_order: list[str] = []  # every KV layer, in forward order
        self._layer_position: dict[str, int] = {}
        # Writes may still run when the forward pass starts. Off by default: on CPU the writing
        # thread competes with the forward pass's threads (hit TTFT measured 97 ms overlapped vs
        # 67 ms not, docs/benchmarks.md); on CUDA the per-layer waits need PIECEWISE CUDA graphs.
        self._overlap = settings.overlap_loads
        self._queue: queue.Queue[Any] = queue.Queue()
        self._saver: threading.Thread | None = None
        self._slow_stores = 0  # stores that ended late since the last line saying so (save thread)
        self._slow_logged_at = -float("inf")
        # Checks of inline loads' copies, during the forward pass; started from the model-runner
        # thread, it moves off that thread's cores as the connector's other threads do.
        self._checker = ThreadPoolExecutor(
            1, thread_name_prefix="tiercache-connector-check", initializer=spread_current_thread
        )
        self.link = link(settings, "vllm-worker", self._on_connect)
        self.stats = {
            "loaded_chunks": 0,
            "load_failures": 0,
            "lost_leases": 0,
            "saved_chunks": 0,
            "save_skipped": 0,
            "corrupt_copies": 0,
            "stale_reservations": 0,
        }
        self.recorder = StatsRecorder()  # the same events per interval, for vLLM's metrics
        self._outages_counted = 0

    # -- start-up: the layout ------------------------------------------------------------------
    def order_layers(self, layer_names: Iterable[str]) -> None:
        """Learn the KV layers' forward order: loads are written (and waited for) in it."""
        self._layer_order = forward_order(layer_names)
        self._layer_position = {name: i for i, name in enumerate(self._layer_order)}

    def _on_connect(self, client: Client) -> None:
        assert self._kv_caches is not None
        layout: EngineLayout = derive_layout(
            self._vllm_config, self._kv_cache_config, client.server.chunk_size, self._settings.weights_id
        )
        groups = layout.for_rank(self._rank)
        forward_context = getattr(self._vllm_config.compilation_config, "static_forward_context", None)
        pages = verify_kv_caches(groups, self._kv_caches, forward_context)
        refs = client.register([(g.object_group, g.manifest) for g in groups])
        for g, ref in zip(groups, refs):
            if ref.fingerprint != g.fingerprint.raw:
                raise ConfigError("tiercache: the server computed another fingerprint for our manifest")
        assert self._copy is not None
        self._copy.attach(client.arena())
        self.use_layout(groups, pages, {g.object_group: g.fingerprint for g in groups}, self._copy)

    def use_layout(
        self,
        groups: list[GroupLayout],
        pages: dict[int, list[PageView]],
        fingerprints: dict[int, Fingerprint],
        copy: PageCopyEngine,
    ) -> None:
        """Load and store ``groups`` (this rank's), whose KV pages are ``pages`` (by KV-cache group),
        with these fingerprints, copying through ``copy`` (attached to the server's arena)."""
        self._copy = copy
        self._pages = pages
        self._fingerprints = fingerprints
        self._groups = groups
