"""The shared-secret proof both ends compute: ``HMAC-SHA256(secret, nonce)``.

Each connection asks the server for a single-use random nonce (:class:`~tiercache.wire.protocol.Challenge`)
and proves the secret in its :class:`~tiercache.wire.protocol.Hello`. The secret never crosses the
wire and a recorded proof cannot be replayed. It authenticates but does not encrypt: on an untrusted
network use CURVE (:mod:`tiercache.server.security`).
"""

from __future__ import annotations

import hashlib
import hmac


def auth_proof(secret: str, nonce: bytes) -> bytes:
    """What a client sends in ``Hello.auth``: HMAC-SHA256 of the server's nonce under the secret."""
    return hmac.new(secret.encode(), nonce, hashlib.sha256).digest()


def check_proof(secret: str, nonce: bytes, proof: bytes) -> bool:
    """Constant-time comparison of a client's proof."""
    return hmac.compare_digest(auth_proof(secret, nonce), proof)
