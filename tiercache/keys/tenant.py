"""Tenants: who a chunk belongs to, named by a digest of the request's cache salt.

A tenant is the cache salt of the requests that stored (or asked for) a chunk; requests without a
salt belong to the *default tenant*. The salt is already hashed into every key (so tenants never share
KV); the tenant id exists so a server can account bytes, hits and evictions per tenant and enforce
quotas. It is an 8-byte BLAKE2b digest, personalised so it matches nothing else derived from the
salt: the server, ``inspect`` and metrics can name a tenant without ever seeing its salt, and an
operator finds the id of a salt they know with ``tiercache tenant-id``.

The wire carries the raw 8 bytes (``b""`` for the default tenant); people see :func:`tenant_label`.
"""

from __future__ import annotations

import hashlib
import re

from tiercache.errors import KeyFormatError

#: Bytes of a tenant id.
TENANT_BYTES = 8
#: The default tenant (requests without a cache salt).
DEFAULT_TENANT = b""
#: How the default tenant is written in settings, tables and metric labels.
DEFAULT_LABEL = "default"
_PERSON = b"tiercache-tnt-v1"  # BLAKE2b personalisation (at most 16 bytes)
_HEX = re.compile(r"^[0-9a-f]{16}$")


def tenant_id(cache_salt: str | None) -> bytes:
    """The tenant id of requests with ``cache_salt`` (:data:`DEFAULT_TENANT` for none or ``""``)."""
    if not cache_salt:
        return DEFAULT_TENANT
    return hashlib.blake2b(cache_salt.encode(), digest_size=TENANT_BYTES, person=_PERSON).digest()


def tenant_label(tenant: bytes) -> str:
    """How people see a tenant id: 16 hex digits, or ``"default"``."""
    return tenant.hex() if tenant else DEFAULT_LABEL


def parse_tenant(text: str) -> bytes:
    """The tenant id written as :func:`tenant_label` writes it; raises :class:`KeyFormatError`."""
    value = text.strip().lower()
    if value == DEFAULT_LABEL:
        return DEFAULT_TENANT
    if not _HEX.match(value):
        raise KeyFormatError(
            f"{text!r} is not a tenant id; use its {2 * TENANT_BYTES} hex digits (`tiercache tenant-id "
            f"SALT` prints them) or {DEFAULT_LABEL!r}"
        )
    return bytes.fromhex(value)


def check_tenant(raw: bytes) -> bytes:
    """``raw`` if it is a well-formed tenant id off the wire (empty or 8 bytes); raises
    :class:`KeyFormatError` otherwise."""
    if len(raw) not in (0, TENANT_BYTES):
        raise KeyFormatError(
            f"a tenant id is {TENANT_BYTES} bytes (or empty for the default), got {len(raw)}"
        )
    return raw
