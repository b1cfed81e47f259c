"""The wire: the versioned protocol between the server and its clients, and the shared-secret proof
both ends compute.

* :mod:`~tiercache.wire.protocol` — msgspec messages, one msgpack frame each;
* :mod:`~tiercache.wire.auth` — ``HMAC-SHA256(secret, nonce)``.

The client that speaks it lives in :mod:`tiercache.client`. The wire knows the arena
(:mod:`tiercache.l1.arena`) but never the server, the engine or a tier (an import contract checks it).
"""
