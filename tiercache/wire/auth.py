"""The shared secret, as both ends use it: a proof at hello, then a key that signs every message.

A connection asks the server for a single-use random nonce (:class:`~tiercache.wire.protocol.Challenge`)
and proves the secret in its :class:`~tiercache.wire.protocol.Hello`: ``HMAC-SHA256(secret, nonce)``.
The secret never crosses the wire and a recorded proof cannot be replayed (the nonce is used once).

A proof alone would authenticate only the hello: whoever copies the connection's routing id could
speak in its name afterwards. So both ends also derive a **session key** from the secret, the
server's nonce and a nonce of the client's (:func:`session_key`), and every later message, both ways,
travels with a second frame, its :class:`SessionSeal` tag: a counter that must grow and a keyed
BLAKE2b MAC of the counter, the direction and the message. A request without a valid tag gets
nothing of the session; a recorded one replayed later carries a counter already seen and is refused;
a reply the server did not sign is not believed. Nothing is encrypted: on an untrusted network use
CURVE (:mod:`tiercache.server.security`), which encrypts and authenticates below this layer.
"""

from __future__ import annotations

import hashlib
import hmac

#: Bytes of a tag frame: the counter (8, little-endian) and the MAC (16).
TAG_BYTES = 24
_COUNTER_BYTES = 8
_MAC_BYTES = 16
#: Personalisations of the MAC per direction, so a request's tag never verifies as a reply's.
_TO_SERVER = b"tiercache-c2s"
_TO_CLIENT = b"tiercache-s2c"
_KEY_LABEL = b"tiercache session key v2\0"


def auth_proof(secret: str, nonce: bytes) -> bytes:
    """What a client sends in ``Hello.auth``: HMAC-SHA256 of the server's nonce under the secret."""
    return hmac.new(secret.encode(), nonce, hashlib.sha256).digest()


def check_proof(secret: str, nonce: bytes, proof: bytes) -> bool:
    """Constant-time comparison of a client's proof."""
    return hmac.compare_digest(auth_proof(secret, nonce), proof)


def session_key(secret: str, nonce: bytes, client_nonce: bytes) -> bytes:
    """The key one session's messages are signed with: fresh for every hello, because the server's
    nonce is single-use and the client's is its own (so neither side can be fed an old session)."""
    return hmac.new(secret.encode(), _KEY_LABEL + nonce + client_nonce, hashlib.sha256).digest()


class SessionSeal:
    """Signs what one end sends and checks what it receives, for one session.

    ``to_server`` says which end this is (``True`` on the client). Counters start at 1 with every
    session; :meth:`open` accepts only a counter above the last one accepted, so a message is taken
    at most once and never after a newer one (one connection delivers in order).
    """

    __slots__ = ("_key", "_recv_person", "_send_person", "received", "sent")

    def __init__(self, key: bytes, *, to_server: bool) -> None:
        self._key = key
        self._send_person = _TO_SERVER if to_server else _TO_CLIENT
        self._recv_person = _TO_CLIENT if to_server else _TO_SERVER
        self.sent = 0  # counter of the last message sealed
        self.received = 0  # counter of the last message accepted

    def _mac(self, person: bytes, counter: bytes, body: bytes) -> bytes:
        h = hashlib.blake2b(counter, key=self._key, digest_size=_MAC_BYTES, person=person)
        h.update(body)
        return h.digest()

    def seal(self, body: bytes) -> bytes:
        """The tag frame to send after ``body``."""
        self.sent += 1
        counter = self.sent.to_bytes(_COUNTER_BYTES, "little")
        return counter + self._mac(self._send_person, counter, body)

    def open(self, body: bytes, tag: bytes) -> bool:
        """Whether ``tag`` is this session's, fresh, for ``body`` (and if so, remember its counter)."""
        if len(tag) != TAG_BYTES:
            return False
        counter = tag[:_COUNTER_BYTES]
        if not hmac.compare_digest(self._mac(self._recv_person, counter, body), tag[_COUNTER_BYTES:]):
            return False
        n = int.from_bytes(counter, "little")
        if n <= self.received:
            return False  # replayed, or older than one already taken
        self.received = n
        return True
