"""The worker half: runs in each vLLM worker process, next to the KV cache.

* ``register_kv_caches`` (once, at start-up): check the derived layout against the real tensors,
  build per layer a page view per manager block over the KV memory, pick the copy engine for the
  tensors' device, connect, register the object groups of this rank and map the server's L1 arena.
* Loads (``handle_preemptions``, at the very start of the step; ``start_load_kv`` is the fallback
  if that hook did not see the step). The scheduler's lookup ticket has promoted the hit objects
  into L1 and pins them until the step has run; the load names their slots, so the worker starts
  a load job (:mod:`~tiercache.connector.loads`) that writes them into the requests' blocks in
  the layers' forward order with no round trip, and trusts the bytes only if the job ended well
  inside the leases' TTL counted from the lookup's send (else the chunks are failed loads). A load
  that names no slots, or slots in another server's arena, pins by key instead (one round trip)
  and releases the pins once the job is finished. Two kinds
  (``RequestLoad.asynchronous``):

  - synchronous (one KV-cache group, dense models): the request runs in this very step. With
    ``overlap_loads`` the writes run during the forward pass and ``wait_for_layer_load`` holds each
    attention layer until its pages are written; without (the default), they precede the forward
    pass (on CUDA: ordered before it on the device, the host does not wait). The job is finished
    at the end of the step (``wait_for_save``); a chunk that cannot be loaded (server gone, object
    evicted, wrong size, a failed write) puts its blocks into ``get_block_ids_with_load_errors``
    and vLLM recomputes them.
  - asynchronous (several KV-cache groups, or recurrent state): vLLM parked the request in
    ``WAITING_FOR_REMOTE_KVS`` and runs it in a later step. At the end of the first step after its
    job is done (this very step unless writes overlap) the request is reported in
    ``finished_recving`` (every worker reports each request once, loaded or not), and a load with
    any failed chunk also in ``failed_recving``: vLLM frees its blocks and computes the request
    from scratch. vLLM cannot map block ids back to requests when there are several groups, so
    none are reported as load errors.
* Recurrent groups (Mamba/GDN state): an object is one state page per layer (the unpadded bytes of
  the ``[blocks, 1, 1, state bytes]`` view); a save reads the block vLLM handed over for the chunk's
  end boundary, a load writes the block it assigned to the hit boundary (``ChunkLoad.state``).
* Saves (``wait_for_save``, after the forward pass): queued to one background thread
  (``tiercache-connector-save``) that reserves arena slots, copies the pages of the chunk's blocks in
  and commits. The scheduler holds finished requests' blocks until ``get_finished`` reports them; it
  waits for that request's queued saves first, so reported blocks are never read again. When
  requests were preempted (their blocks may be rewritten this step) every queued save is finished
  before the forward pass (``handle_preemptions``). A producer (``kv_role`` ``kv_producer``: a
  prefill engine whose decode engine asks the same server next) reserves this step's chunks in
  ``wait_for_save`` itself (one round trip, bounded by ``timeout_s``, not behind the copies still
  queued), and the thread then copies and commits them: its response
  can then never reach the decode engine before the server knows the chunks are coming, and a
  decode lookup waits for their commit (``inflight_wait_s``) instead of missing.

Copies go through a :class:`~tiercache.connector.copy.PageCopyEngine` chosen from the KV tensors'
device (CPU: plain ``torch`` copies; CUDA: pinned arena, DMA on a side stream ordered by events), over
per-layer :class:`~tiercache.connector.pages.PageView` at manager-block granularity (vLLM may split
a manager block into kernel blocks and lay pages out as several runs).
"""

from __future__ import annotations

import logging
import threading

import torch

from tiercache.client.affinity import describe_binding
from tiercache.connector.copy import select_copy_engine
from tiercache.connector.layout import parallel_rank
from tiercache.connector.metadata import TierCacheMetadata
from tiercache.connector.stats import TierCacheConnectorStats
from tiercache.connector.worker_saves import _STOP, WorkerSaves

log = logging.getLogger(__name__)


class WorkerHalf(WorkerSaves):
    """See the module docstring. Engine-facing methods run on the worker's model-runner thread.

    One object with one set of fields, in layers:
    :class:`~tiercache.connector.worker_core.WorkerCore` (the fields, the layout) →
    :class:`~tiercache.connector.worker_loads.WorkerLoads` (loads) →
    :class:`~tiercache.connector.worker_saves.WorkerSaves` (saves) → this class (start-up, the
    step's first hook, step results, shutdown)."""

    # -- start-up ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # Which object groups are this worker's (one per KV-cache group); raises rather than guess.
        self._rank = parallel_rank(getattr(self._vllm_config, "parallel_config", None))
        self._kv_caches = kv_caches
        self.order_layers(kv_caches)
        self._copy = select_copy_engine(kv_caches.values())
        binding = describe_binding()
        if binding is not None:
            log.info("tiercache: %s", binding)
        self.link.start()
        self._saver = threading.Thread(target=self._save_loop, name="tiercache-connector-save", daemon=True)
        self._saver.start()

    # -- step boundaries -----------------------------------------------------------------------
    def handle_preemptions(self, meta: TierCacheMetadata | None) -> None:
        """The first hook of every step, before vLLM prepares inputs: finish queued saves whose
        blocks may be rewritten (``meta.flush``), then do this step's loads (see module docstring)."""
        if self._sync_load is not None:  # the last step ended without its end-of-step hooks
            self._finish_loads(wait=False)
        if meta is not None and meta.flush:
            self._wait_idle(None)
        self.start_load_kv(meta)

    def quiesce(self) -> None:
        """Finish every load in flight (reported as usual) and every queued store: afterwards the
        connector touches no KV block until the next step."""
        self._finish_loads(wait=True)
        self._wait_idle(None)

    # -- step results --------------------------------------------------------------------------
    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` for this step: the asynchronous
        loads done since the last call (failed ones in both of the last two), and the finished
        requests whose blocks the scheduler held for our stores, once those are done."""
        self._finish_loads(wait=False)
        with self._lock:
            recving, self._recv_done = self._recv_done, set()
            failed, self._recv_failed = self._recv_failed, set()
        sending, _ = self.get_finished(finished_req_ids)
        return sending or set(), recving, failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Report requests whose blocks the scheduler held for our stores, once those are done
        (loads are reported by :meth:`transfer_results`, which calls this).

        Waits for the finishing requests' own queued stores (usually already done: they were
        queued steps ago), so a reported request's blocks are never read again.
        """
        with self._lock:
            self._finished_waiting.update(r for r in finished_req_ids if r in self._with_saves)
            waiting = list(self._finished_waiting)
        if not waiting:
            return None, None
        for rid in waiting:
            self._wait_idle(rid)
        with self._lock:
            for rid in waiting:
                self._with_saves.discard(rid)
                self._finished_waiting.discard(rid)
        return set(waiting), None

    def take_stats(self) -> TierCacheConnectorStats | None:
        """Loads and stores since the last call, and server outages this worker noticed."""
        outages = self.link.outages
        if outages != self._outages_counted:
            self.recorder.add("server_unavailable", outages - self._outages_counted)
            self._outages_counted = outages
        return self.recorder.take()

    def shutdown(self) -> None:
        """Finish loads in flight and queued stores (bounded by the client's timeouts), then disconnect."""
        self._finish_loads(wait=True)
        if self._saver is not None and self._saver.is_alive():
            self._queue.put(_STOP)
            self._saver.join(30)
        self.link.close()
        if self._copy is not None:
            self._copy.close()
        self._checker.shutdown(wait=True)
