"""The wire: the versioned protocol between the server and its clients, the one client, and the
shared-secret proof both ends compute.

* :mod:`~tiercache.wire.protocol` — msgspec messages, one msgpack frame each;
* :mod:`~tiercache.wire.client` — :class:`~tiercache.wire.client.Client`, used by the vLLM connector,
  the CLI and the tests; it moves KV bytes through the shared L1 arena, never the socket;
* :mod:`~tiercache.wire.auth` — ``HMAC-SHA256(secret, nonce)``.

The wire knows the arena (:mod:`tiercache.l1.arena`) but never the server, the engine or a tier:
a vLLM worker that imports the client loads neither LMDB nor boto3 (an import contract checks it).
"""
