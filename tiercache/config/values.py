"""Parsers of user-given values shared by every way of setting them (flags, environment, files,
vLLM's ``kv_connector_extra_config``). Each returns the value or says, in one line, what is wrong."""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiercache.errors import ConfigError, KeyFormatError
from tiercache.keys.tenant import parse_tenant

#: Tier names in the only order they can be stacked: fastest first.
TIER_ORDER = ("l1", "disk", "s3")

#: What ``tiercache server`` runs with no flags: the embedded default.
DEFAULT_TIERS = ("l1", "disk")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(raw: Any) -> bool | None:
    """``raw`` as a boolean: a bool, or true/false, 1/0, yes/no, on/off in any case (and the ints 1
    and 0); ``None`` for anything else, so each caller words its own error."""
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower() if isinstance(raw, str | int) else ""
    return True if text in _TRUE else False if text in _FALSE else None


def parse_tier_list(
    text: str | Sequence[str], where: str = "--tiers", *, stack: bool = True
) -> tuple[str, ...]:
    """``"l1,disk"`` → ``("l1", "disk")``: known names, each once, not empty.

    ``stack=True`` (a server's tiers) also requires l1 first and the tiers fastest first, since the
    engine stacks them in that order; ``stack=False`` takes any subset in any order (``tiercache
    bench`` measures tiers one by one).
    """
    items = text.split(",") if isinstance(text, str) else list(text)
    tiers = tuple(str(t).strip() for t in items if str(t).strip())
    shown = ",".join(tiers) if tiers else repr(text)
    unknown = [t for t in tiers if t not in TIER_ORDER]
    if not tiers or unknown:
        use = (
            "use l1,disk, l1,s3 or l1,disk,s3"
            if stack
            else f"use a comma-separated subset of {','.join(TIER_ORDER)}, e.g. l1,disk"
        )
        raise ConfigError(
            f"{where} {shown} is not valid ({'unknown: ' + ','.join(unknown) if unknown else 'empty'}); {use}"
        )
    if len(set(tiers)) != len(tiers):
        raise ConfigError(f"{where} {shown} names a tier twice; name each once, e.g. l1,disk,s3")
    if not stack:
        return tiers
    if tiers[0] != "l1":
        raise ConfigError(
            f"{where} {shown} does not start with l1; l1 (the shared-memory arena) is always required "
            f"because workers copy KV through it: use l1,{','.join(t for t in tiers if t != 'l1')}"
            if "l1" not in tiers
            else f"{where} {shown} must start with l1 (tiers go fastest first): use "
            f"{','.join(t for t in TIER_ORDER if t in tiers)}"
        )
    ordered = tuple(t for t in TIER_ORDER if t in tiers)
    if tiers != ordered:
        raise ConfigError(f"{where} {shown} is out of order; tiers go fastest first: use {','.join(ordered)}")
    return tiers


def parse_tenant_shares(text: str) -> dict[bytes, float]:
    """``"3f2a…=0.5,default=0.2"`` → ``{tenant id: share}``: per-tenant overrides of the default
    share, each a fraction in (0, 1] of a tier's budget, each tenant named once (by the id
    ``tiercache tenant-id`` prints, or ``default``). Empty text: no overrides.

    Raises :class:`ValueError` whose message completes the setting's name ("... has ...; use ...").
    """
    shares: dict[bytes, float] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"has {item!r}, which is not TENANT=SHARE; write e.g. 3f2a9c0d1e2b4a5f=0.5")
        try:
            tenant = parse_tenant(name)
        except KeyFormatError as exc:
            raise ValueError(f"names a bad tenant: {exc}") from None
        try:
            share = float(value)
        except ValueError:
            share = float("nan")
        if not 0 < share <= 1:
            raise ValueError(f"gives {name.strip()} the share {value!r}; give a fraction in (0, 1]")
        if tenant in shares:
            raise ValueError(f"names tenant {name.strip()} twice; name each once")
        shares[tenant] = share
    return shares


#: The least key material a shared secret must carry: a recorded handshake lets an eavesdropper
#: check guesses offline (docs/server.md, threat model), so a secret must be beyond guessing.
SECRET_BITS = 128

#: How to make a secret that passes (said by every refusal).
MAKE_A_SECRET = (
    "make one with `openssl rand -hex 32` or `python3 -c 'import secrets; print(secrets.token_hex(32))'`"
)

_CLASSES = (string.ascii_lowercase, string.ascii_uppercase, string.digits)


def secret_weakness(secret: str) -> str | None:
    """Why ``secret`` is too weak for a shared secret, or ``None``. An upper bound of its key
    material: its length times log2 of the alphabets it draws on (lower case, upper case, digits,
    the rest), which must reach :data:`SECRET_BITS`, and at least 8 distinct characters. A phrase
    that passes may still be guessable; a random one of 32 hex digits or more always passes."""
    alphabet = sum(len(c) for c in _CLASSES if any(ch in c for ch in secret))
    if any(not any(ch in c for c in _CLASSES) for ch in secret):
        alphabet += 33  # punctuation, space and anything else
    bits = len(secret) * math.log2(alphabet) if alphabet else 0.0
    distinct = len(set(secret))
    if bits >= SECRET_BITS and distinct >= 8:
        return None
    what = (
        f"holds at most {bits:.0f} bits of key material ({len(secret)} characters)"
        if bits < SECRET_BITS
        else f"repeats {distinct} distinct characters"
    )
    return (
        f"the shared secret {what}, under the {SECRET_BITS} bits a secret needs: a recorded handshake "
        f"lets anyone check guesses of it offline; {MAKE_A_SECRET}"
    )


def read_secret_file(path: Path, name: str = "auth_secret_file") -> str:
    """The shared secret in ``path``: its first line (surrounding blanks dropped). Raises
    :class:`ConfigError` naming ``name`` when the file cannot be read or holds nothing."""
    path = path.expanduser()
    try:
        lines = path.read_text().strip().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigError(f"{name}={str(path)!r} cannot be read: {reason}") from None
    if not lines or not lines[0].strip():
        raise ConfigError(f"{name}={str(path)!r} is empty; write the shared secret on its first line")
    return lines[0].strip()
