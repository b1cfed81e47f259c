"""L1: hot chunks in a shared host-memory arena, the only tier the inference engine copies to/from.

Two halves that different processes import:

* the **data plane** every worker maps and copies through — :mod:`~tiercache.l1.arena` (the
  ``/dev/shm`` arena) and :mod:`~tiercache.l1.copy` (CPU memcpy and CUDA async-DMA back-ends);
* the **tier** the server owns — :mod:`~tiercache.l1.tier` (:class:`~tiercache.l1.tier.L1Tier`,
  built on its state in :mod:`~tiercache.l1.core` and its batch operations in
  :mod:`~tiercache.l1.slots`), its slot :mod:`~tiercache.l1.allocator`, eviction
  :mod:`~tiercache.l1.policy` and tenant quotas (:mod:`~tiercache.l1.tenants`).

This package imports neither on purpose, so a worker that maps the arena loads nothing of the tier
(nor torch: :class:`~tiercache.l1.copy.CudaCopyBackend` imports it when constructed).
"""
