"""``TierCacheConnector``: the class vLLM instantiates, once per role.

vLLM builds two independent instances: one with role SCHEDULER in the scheduler (EngineCore) process
and one with role WORKER in each worker process. This class only routes each hook to the half for its
role (:mod:`tiercache.connector.scheduler`, :mod:`tiercache.connector.worker`); they share nothing but
the metadata vLLM pickles from the scheduler to the workers every step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from tiercache.config.connector import ConnectorSettings
from tiercache.connector.stats import (
    TierCacheConnectorStats,
    TierCachePromMetrics,
    build_stats,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        PromMetric,
        PromMetricT,
    )
    from vllm.v1.core.sched.output import SchedulerOutput

log = logging.getLogger(__name__)


def adopt_log_handlers(ours: logging.Logger, theirs: logging.Logger) -> None:
    """Send ``ours`` (tiercache's loggers) through ``theirs``'s handlers (vLLM's), at its level,
    unless ``ours`` already has handlers of its own.

    vLLM configures only its ``vllm`` logger: without this the connector's start-up and connection
    lines (INFO) never reach vLLM's log, and its warnings come out unformatted through Python's
    last-resort handler. Like ``vllm``, ``ours`` then stops propagating, so nothing prints twice."""
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


def describe_role(kv_role: str | None) -> str:
    """What the connector does in ``kv_role`` (logged once at start-up)."""
    if kv_role == "kv_producer":
        return (
            "kv_role kv_producer: stores every full prompt chunk and never loads (a prefill engine); "
            "each step's stores are reserved on the server before the step returns, so a decode "
            "engine asking next waits for them instead of missing"
        )
    if kv_role == "kv_consumer":
        return "kv_role kv_consumer: loads what the server holds and never stores (a decode engine)"
    return "kv_role kv_both: loads what the server holds and stores what this engine computes"


class TierCacheConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]  # vLLM is untyped: its bases are Any
    """tiercache as a vLLM v1 KV connector (settings: see docs/vllm.md)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        adopt_log_handlers(logging.getLogger("tiercache"), logging.getLogger("vllm"))
        transfer = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(
            transfer.kv_connector_extra_config if transfer else None
        )
        self._scheduler = None
        self._worker = None
        # vLLM's kv_role: kv_producer stores and never loads, kv_consumer loads and never stores.
        loads = bool(transfer.is_kv_consumer) if transfer is not None else True
        stores = bool(transfer.is_kv_producer) if transfer is not None else True
        if role == KVConnectorRole.SCHEDULER:
            from tiercache.connector.scheduler import SchedulerHalf

            log.info("tiercache: %s", describe_role(transfer.kv_role if transfer is not None else None))
            if (
                loads
                and transfer is not None
                and getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute"
            ):
                log.warning(
                    "tiercache: kv_load_failure_policy is %r: a chunk that fails to load fails its request. "
                    'Set "kv_load_failure_policy": "recompute" in --kv-transfer-config so vLLM '
                    "recomputes instead.",
                    transfer.kv_load_failure_policy,
                )
            self._scheduler = SchedulerHalf(
                vllm_config, kv_cache_config, self.settings, loads=loads, stores=stores
            )
        else:
            from tiercache.connector.worker import WorkerHalf

            self._worker = WorkerHalf(
                vllm_config, kv_cache_config, self.settings, reserve_before_return=stores and not loads
            )

    # A best-effort cache: a preempted request is simply recomputed.
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    # Sleep mode: vLLM >= 0.33 calls these around discarding and re-mapping the KV cache (0.32 has no
    # such hooks and never calls them). The tensors keep their addresses across a sleep; only the
    # loads and stores still in flight must not touch blocks whose memory is being released.
    def unregister_kv_caches(self) -> None:
        """Before sleep mode discards the KV cache: finish the loads writing into it and the queued
        stores reading from it."""
        if self._worker is not None:
            self._worker.quiesce()

    def restore_kv_caches(self) -> None:
        return  # after wake-up: same tensors at the same addresses, nothing to re-register

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None:
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is not None and self.has_connector_metadata():
            self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Called by every attention layer before it reads its KV: wait for that layer's loaded pages."""
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # stores are whole chunks of every layer, queued in wait_for_save

    def wait_for_save(self) -> None:
        if self._worker is not None and self.has_connector_metadata():
            self._worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return self._worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished stores, and this step's asynchronous loads: done ones in ``finished_recving``,
        failed ones in ``failed_recving`` as well (vLLM then computes those requests)."""
        if self._worker is None:
            return KVConnectorTransferResults()
        sending, recving, failed = self._worker.transfer_results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    # -- statistics (docs/vllm.md, "Metrics") -----------------------------------------------------
    def get_kv_connector_stats(self) -> TierCacheConnectorStats | None:
        """This half's stats since the last call (vLLM calls it every step, in both roles)."""
        half = self._worker if self._worker is not None else self._scheduler
        return half.take_stats() if half is not None else None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True when loads overlap the forward pass (``overlap_loads``): the layer-by-layer waits
        run only between PIECEWISE CUDA graph pieces, never in a FULL graph."""
        return ConnectorSettings.from_extra_config(extra_config).overlap_loads

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TierCacheConnectorStats:
        """Rebuild the stats object in vLLM's stat loggers from its serialized ``data``."""
        return build_stats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> TierCachePromMetrics:
        """The ``vllm:tiercache_*`` Prometheus metrics."""
        return TierCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        """Keep vLLM's engine stepping (it collects :meth:`take_events` only then) until the chunks
        just stored have been reported by a tier, so their events do not wait for the next request."""
        return self._scheduler is not None and self._scheduler.has_pending_events()

    def take_events(self) -> Iterable[Any]:
        """tiercache's KV events (``BlockStored`` / ``BlockRemoved`` per tier) for vLLM's event stream."""
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)
