"""The client side of the data path: what an engine's processes run to talk to the server and move
KV bytes through its shared L1 arena.

* :mod:`~tiercache.client.client` — :class:`~tiercache.client.client.Client`, the one client of the
  server (the engine adapters, the CLI and the tests use it);
* :mod:`~tiercache.client.transfer` — the data path's rules, written once: slots and their arena
  from one session, the time window of a hold, the writer's digest and the reader's check
  (:class:`~tiercache.client.transfer.Store`, :class:`~tiercache.client.transfer.Load`);
* :mod:`~tiercache.client.link` — a connection that reconnects in the background and tells its owner
  when the server is away (:class:`~tiercache.client.link.ServerLink`);
* :mod:`~tiercache.client.affinity` — which CPUs the client's threads run on;
* :mod:`~tiercache.client.tensors` — torch views of the arena and digests of tensors (imports torch).

The engine adapters (:mod:`tiercache.connector` for vLLM, :mod:`tiercache.sglang`) sit on top and know
nothing of each other. Nothing here imports the server side (a tier, LMDB, boto3): an import
contract checks it.
"""
