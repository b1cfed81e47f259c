"""How the server refuses: a request it answers with an error reply, and the one mapping from an
exception to the reply the client gets. A refusal never escapes the request loop."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tiercache.errors import (
    ConfigError,
    KeyFormatError,
    LeaseError,
    ReservationError,
    TierCacheError,
    TierFullError,
)
from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey
from tiercache.keys.tenant import check_tenant
from tiercache.wire import protocol as p

log = logging.getLogger(__name__)

#: A request handler: given the session and the decoded message, the reply to send now, or
#: ``None`` when the reply comes later (the work was offloaded to the I/O executor).
Handler = Callable[[Any, Any], p.Message | None]


class Refused(Exception):
    """A request the server answers with an error reply (never escapes the loop)."""

    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def error_reply(req_id: int, exc: BaseException) -> p.ErrorReply:
    """The error reply for a request that raised ``exc``; an unexpected exception is logged."""
    if isinstance(exc, Refused):
        code, message = exc.code, exc.message
    elif isinstance(exc, TierFullError):
        code, message = p.ErrorCode.TIER_FULL, str(exc)
    elif isinstance(exc, ReservationError | LeaseError):
        code, message = p.ErrorCode.UNKNOWN_TOKEN, str(exc)
    elif isinstance(exc, KeyFormatError | ConfigError | ValueError):
        code, message = p.ErrorCode.INVALID, str(exc)
    elif isinstance(exc, TierCacheError):
        code, message = p.ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"
    else:
        log.exception("request %d failed", req_id, exc_info=exc)
        code, message = p.ErrorCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"
    return p.ErrorReply(req_id=req_id, code=code, message=message)


class Offload(Protocol):
    """Run ``job`` on the I/O executor; ``finish(result)`` then runs on the request loop and its
    reply is sent to the session, then ``sent(reply)`` is called (``reply`` is ``None`` when nothing
    was sent). Raises :class:`Refused` (``busy``) when the executor already has its bound of jobs."""

    def __call__(
        self,
        session: Any,
        req_id: int,
        job: Callable[[], Any],
        finish: Callable[[Any], p.Message | None],
        sent: Callable[[p.Message | None], None] | None = None,
    ) -> None: ...


class Complete(Protocol):
    """Hand ``result``, computed on the request loop without I/O, to ``finish`` as an offloaded
    job's result would be: ``finish(result)`` runs on the loop, its reply is sent, then
    ``sent(reply)`` is called, all before the loop waits again."""

    def __call__(
        self,
        session: Any,
        req_id: int,
        result: Any,
        finish: Callable[[Any], p.Message | None],
        sent: Callable[[p.Message | None], None] | None = None,
    ) -> None: ...


def parse_key(raw: bytes) -> ObjectKey:
    """The object key encoded in ``raw``, or :class:`Refused` (``invalid``)."""
    try:
        return ObjectKey.from_bytes(raw)
    except KeyFormatError as exc:
        raise Refused(p.ErrorCode.INVALID, str(exc)) from exc


def request_keys(msg: p.Message) -> int:
    """How many keys (chunk hashes × groups, keys, objects and held blocks, tokens) ``msg`` names:
    what the request loop works through for it."""
    if isinstance(msg, p.Lookup):
        return len(msg.hashes) * max(1, len(msg.groups)) + len(msg.releases)
    if isinstance(msg, p.Explain):
        return len(msg.hashes) * max(1, len(msg.groups))
    if isinstance(msg, p.ReleaseTickets):
        return len(msg.releases)
    if isinstance(msg, p.Pin):
        return len(msg.keys) + len(msg.releases)
    if isinstance(msg, p.Warm):
        return len(msg.keys)
    if isinstance(msg, p.Reserve):
        return len(msg.items) + sum(len(blocks) for _, blocks in msg.holds)
    if isinstance(msg, (p.Commit, p.Abort, p.Release)):
        return len(msg.tokens) + len(getattr(msg, "supersedes", ()))
    if isinstance(msg, p.Corrupt):
        return len(msg.objects)
    if isinstance(msg, p.RegisterEngine):
        return len(msg.groups)
    return 0


def parse_keys(raws: Sequence[bytes]) -> list[ObjectKey]:
    """:func:`parse_key` of each of ``raws`` (faster for many)."""
    try:
        return ObjectKey.from_bytes_many(raws)
    except KeyFormatError as exc:
        raise Refused(p.ErrorCode.INVALID, str(exc)) from exc


def check_keys(raws: Sequence[bytes]) -> None:
    """:class:`Refused` (``invalid``) unless each of ``raws`` is an object key's binary form."""
    try:
        ObjectKey.check_many(raws)
    except KeyFormatError as exc:
        raise Refused(p.ErrorCode.INVALID, str(exc)) from exc


def parse_tenant_id(raw: bytes) -> bytes:
    """The tenant id in ``raw`` (empty or 8 bytes), or :class:`Refused` (``invalid``)."""
    try:
        return check_tenant(raw)
    except KeyFormatError as exc:
        raise Refused(p.ErrorCode.INVALID, str(exc)) from exc


def parse_fingerprint(raw: bytes) -> Fingerprint:
    """The fingerprint in ``raw``, or :class:`Refused` (``invalid``)."""
    try:
        return Fingerprint(raw)
    except KeyFormatError as exc:
        raise Refused(p.ErrorCode.INVALID, str(exc)) from exc
