"""What ``tiercache inspect`` reports, as plain JSON-ready dicts, from a live server or offline storage.

Two sources answer the same four questions (``summary``, ``keys``, ``fingerprints``, ``explain``):

* :class:`LiveSource` asks a running server through :class:`~tiercache.client.client.Client` (``stats``,
  ``list_keys``, ``manifest``, ``explain``). Counters (hits, evictions, verify failures, queue drops)
  and eviction reasons exist only here: they live in the server's memory.
* :class:`OfflineSource` reads a disk tier (:class:`~tiercache.l2_disk.reader.DiskReader`) and/or an S3
  prefix (:class:`~tiercache.l3_s3.reader.S3Reader`) strictly read-only. It knows what is stored, not
  why something is gone, so ``explain`` never answers ``evicted`` offline.

The dict shapes are the ``--json`` output of the CLI and are documented in ``docs/operations.md``;
fields are only ever added. Nothing here prints, exits or knows about argparse or rich.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from tiercache.errors import ConfigError, KeyFormatError, ServerError
from tiercache.keys.fingerprint import Fingerprint, LayoutManifest
from tiercache.keys.object_key import ObjectKey
from tiercache.tier.contract import TierUsage
from tiercache.wire.protocol import GroupRef

#: Bumped only if a field of the JSON output changes meaning (fields may be added any time).
JSON_FORMAT = 1
_LIST_PAGE = 10_000


@dataclass(frozen=True, slots=True)
class KeyFilter:
    """Which keys ``keys`` lists: one tier, one fingerprint, one object group (``None``: any)."""

    tier: str | None = None
    fingerprint: Fingerprint | None = None
    object_group: int | None = None


class _Reader(Protocol):
    name: str

    def usage(self) -> TierUsage: ...
    def iter_keys(self) -> Iterator[ObjectKey]: ...
    def contains(self, key: ObjectKey) -> bool: ...
    def iter_manifests(self) -> Iterator[tuple[Fingerprint, bytes]]: ...
    def get_manifest(self, fingerprint: Fingerprint) -> bytes | None: ...
    def close(self) -> None: ...


def hit_rate(hits: int, misses: int) -> float | None:
    """``hits / (hits + misses)``, or ``None`` before the first lookup."""
    total = hits + misses
    return None if total == 0 else hits / total


def manifest_row(fp: Fingerprint, manifest: LayoutManifest | None, groups: dict[int, int]) -> dict[str, Any]:
    """One entry of ``fingerprints``: the fingerprint, object counts per group and its manifest."""
    return {
        "fingerprint": fp.hex,
        "objects": sum(groups.values()),
        "groups": {str(g): n for g, n in sorted(groups.items())},
        "manifest": None if manifest is None else manifest.to_dict(),
    }


def _entry(chunk: int, h: bytes, fp: Fingerprint, group: int, status: str, **more: Any) -> dict[str, Any]:
    return {
        "chunk": chunk,
        "hash": h.hex(),
        "fingerprint": fp.hex,
        "object_group": group,
        "status": status,
        "tier": more.get("tier") or None,
        "reason": more.get("reason") or None,
        "age_s": more.get("age_s"),
        "other_fingerprint": more.get("other_fingerprint") or None,
    }


def explain_report(
    chunk_size: int,
    n_tokens: int,
    hashes: Sequence[bytes],
    groups: Sequence[tuple[Fingerprint, int]],
    entries: list[dict[str, Any]],
) -> dict[str, Any]:
    """Wrap explain entries with the request and the restorable prefix (all groups held)."""
    held: dict[int, int] = {}
    for e in entries:
        if e["status"] not in ("never_stored", "evicted", "other_fingerprint"):
            held[e["chunk"]] = held.get(e["chunk"], 0) + 1
    prefix = 0
    while prefix < len(hashes) and held.get(prefix, 0) == len(groups):
        prefix += 1
    return {
        "format": JSON_FORMAT,
        "chunk_size": chunk_size,
        "tokens": n_tokens,
        "chunks": len(hashes),
        "groups": [{"fingerprint": fp.hex, "object_group": g} for fp, g in groups],
        "prefix_chunks": prefix if groups else 0,
        "entries": entries,
    }


class LiveSource:
    """Answers from a running server. ``client`` is owned by the caller."""

    live = True

    def __init__(self, client: Any) -> None:
        self.client = client
        self.where = client.endpoint

    def chunk_size(self) -> int:
        return int(self.client.server.chunk_size)

    def summary(self) -> dict[str, Any]:
        stats = self.client.stats()
        tiers = {}
        for name, t in stats.get("tiers", {}).items():
            tiers[name] = {**t, "hit_rate": hit_rate(int(t.get("hits", 0)), int(t.get("misses", 0)))}
        return {
            "format": JSON_FORMAT,
            "source": "server",
            "where": self.where,
            "tiers": tiers,
            "engine": stats.get("engine", {}),
            "server": stats.get("server", {}),
            "tenants": stats.get("tenants", {}),
        }

    def keys(self, flt: KeyFilter, limit: int, cursor: bytes) -> tuple[list[dict[str, Any]], bytes]:
        try:
            page, nxt = self.client.list_keys(
                tier=flt.tier or "",
                fingerprint=flt.fingerprint,
                object_group=-1 if flt.object_group is None else flt.object_group,
                cursor=cursor,
                limit=limit,
            )
        except ServerError as exc:
            if exc.code == "invalid":
                raise ConfigError(f"--tier: {exc}") from exc
            raise
        return [{"key": ObjectKey.from_bytes(k.key).text(), "tiers": list(k.tiers)} for k in page], nxt

    def _all_keys(self) -> Iterator[ObjectKey]:
        cursor = b""
        while True:
            page, cursor = self.client.list_keys(cursor=cursor, limit=_LIST_PAGE)
            for k in page:
                yield ObjectKey.from_bytes(k.key)
            if not cursor:
                return

    def known_groups(self) -> dict[Fingerprint, dict[int, int]]:
        """Object counts per fingerprint and group, over every key the server lists."""
        seen: dict[Fingerprint, dict[int, int]] = {}
        for key in self._all_keys():
            groups = seen.setdefault(key.fingerprint, {})
            groups[key.object_group] = groups.get(key.object_group, 0) + 1
        return seen

    def fingerprints(self) -> list[dict[str, Any]]:
        return [
            manifest_row(fp, self.client.manifest(fp), g) for fp, g in sorted(self.known_groups().items())
        ]

    def explain(
        self, hashes: Sequence[bytes], groups: Sequence[tuple[Fingerprint, int]]
    ) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for fp, group in groups:  # one request per group: an unknown fingerprint names itself
            try:
                entries = self.client.explain(hashes, [GroupRef(fp.raw, group)])
            except ServerError as exc:
                if exc.code == "unknown_fingerprint":
                    raise ConfigError(
                        f"--fingerprint {fp.hex}: the server knows no manifest for it; list known ones "
                        "with `tiercache inspect fingerprints`"
                    ) from exc
                raise
            for e in entries:
                other = Fingerprint(e.other_fingerprint).hex if e.other_fingerprint else None
                out.append(
                    _entry(
                        e.chunk,
                        hashes[e.chunk],
                        fp,
                        e.object_group,
                        e.status,
                        tier=e.tier,
                        reason=e.reason,
                        age_s=e.age_s if e.status == "evicted" else None,
                        other_fingerprint=other,
                    )
                )
        return out

    def close(self) -> None:
        """The client belongs to the caller; nothing to do."""


class OfflineSource:
    """Answers from storage read directly and read-only (disk and/or S3 readers, fastest first)."""

    live = False

    def __init__(self, readers: Sequence[_Reader], where: str) -> None:
        self.readers = list(readers)
        self.where = where

    def summary(self) -> dict[str, Any]:
        tiers: dict[str, Any] = {}
        for r in self.readers:
            u = r.usage()
            tiers[r.name] = {
                "bytes_used": u.bytes_used,
                "bytes_budget": u.bytes_budget or None,
                "objects": u.objects,
                "fingerprints": sum(1 for _ in r.iter_manifests()),
            }
        return {"format": JSON_FORMAT, "source": "offline", "where": self.where, "tiers": tiers}

    def _merged(self, flt: KeyFilter) -> dict[bytes, list[str]]:
        found: dict[bytes, list[str]] = {}
        for r in self.readers:
            if flt.tier and r.name != flt.tier:
                continue
            for key in r.iter_keys():
                if flt.fingerprint is not None and key.fingerprint != flt.fingerprint:
                    continue
                if flt.object_group is not None and key.object_group != flt.object_group:
                    continue
                found.setdefault(key.to_bytes(), []).append(r.name)
        return found

    def keys(self, flt: KeyFilter, limit: int, cursor: bytes) -> tuple[list[dict[str, Any]], bytes]:
        names = [r.name for r in self.readers]
        if flt.tier and flt.tier not in names:
            raise ConfigError(
                f"--tier {flt.tier!r} is not among the tiers inspected here ({', '.join(names)}); "
                "use one of those or drop --tier"
            )
        found = self._merged(flt)
        ordered = sorted(raw for raw in found if raw > cursor)
        page = ordered[:limit]
        nxt = page[-1] if len(ordered) > limit else b""
        return [{"key": ObjectKey.from_bytes(raw).text(), "tiers": found[raw]} for raw in page], nxt

    def _manifests(self) -> dict[Fingerprint, LayoutManifest | None]:
        out: dict[Fingerprint, LayoutManifest | None] = {}
        for r in self.readers:
            for fp, data in r.iter_manifests():
                if out.get(fp) is None:
                    try:
                        out[fp] = LayoutManifest.from_dict(msgspec.json.decode(data))
                    except (msgspec.DecodeError, KeyFormatError):
                        out[fp] = None
        return out

    def known_groups(self) -> dict[Fingerprint, dict[int, int]]:
        seen: dict[Fingerprint, dict[int, int]] = {fp: {} for fp in self._manifests()}
        for raw in self._merged(KeyFilter()):
            key = ObjectKey.from_bytes(raw)
            groups = seen.setdefault(key.fingerprint, {})
            groups[key.object_group] = groups.get(key.object_group, 0) + 1
        return seen

    def fingerprints(self) -> list[dict[str, Any]]:
        manifests = self._manifests()
        return [manifest_row(fp, manifests.get(fp), g) for fp, g in sorted(self.known_groups().items())]

    def explain(
        self, hashes: Sequence[bytes], groups: Sequence[tuple[Fingerprint, int]]
    ) -> list[dict[str, Any]]:
        known = sorted(self.known_groups())
        out: list[dict[str, Any]] = []
        for fp, group in groups:
            for i, h in enumerate(hashes):
                key = ObjectKey(fp, group, h)
                holder = next((r.name for r in self.readers if r.contains(key)), None)
                if holder is not None:
                    out.append(_entry(i, h, fp, group, holder))
                    continue
                other = next(
                    (
                        o
                        for o in known
                        if o != fp and any(r.contains(ObjectKey(o, group, h)) for r in self.readers)
                    ),
                    None,
                )
                if other is not None:
                    out.append(_entry(i, h, fp, group, "other_fingerprint", other_fingerprint=other.hex))
                else:
                    out.append(_entry(i, h, fp, group, "never_stored"))
        return out

    def close(self) -> None:
        for r in self.readers:
            r.close()


__all__ = ["JSON_FORMAT", "KeyFilter", "LiveSource", "OfflineSource", "explain_report", "hit_rate"]
