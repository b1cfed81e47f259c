"""The management requests: stats, listing keys, manifests, ``explain``, clearing and warming.

All of them may touch L2/L3, so each is offloaded to the I/O executor; the request loop only checks
the arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

from tiercache.engine import TieredEngine
from tiercache.errors import TierCacheError
from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey
from tiercache.server.layouts import Layouts, check_hashes
from tiercache.server.records import EvictionRecord
from tiercache.server.replies import (
    Handler,
    Offload,
    Refused,
    parse_fingerprint,
    parse_key,
)
from tiercache.server.sessions import Session
from tiercache.server.tenants import MAX_TENANTS, TenantLookups, with_tenants
from tiercache.tier.contract import Tier
from tiercache.wire import protocol as p

#: Largest page a list_keys request may ask for (and the largest clear or warm batch).
MAX_PAGE = 10_000


class ManagementOps:
    """Handlers of the management requests. Every method runs on the request loop.

    ``server_stats`` gives the server's own counters (clients, requests, what they hold) for the
    ``stats`` reply; it is called on the loop, so it may read the loop's state.
    """

    def __init__(
        self,
        engine: TieredEngine,
        layouts: Layouts,
        evictions: EvictionRecord,
        offload: Offload,
        server_stats: Callable[[], dict[str, int]],
        tenant_lookups: TenantLookups,
    ) -> None:
        self._engine = engine
        self._layouts = layouts
        self._evictions = evictions
        self._offload = offload
        self._server_stats = server_stats
        self._tenant_lookups = tenant_lookups

    def handlers(self) -> dict[type, Handler]:
        return {
            p.Stats: self.stats,
            p.ListKeys: self.list_keys,
            p.GetManifest: self.manifest,
            p.Explain: self.explain,
            p.Clear: self.clear,
            p.ClearBatch: self.clear_batch,
            p.Warm: self.warm,
        }

    def stats(self, session: Session, msg: p.Stats) -> None:
        server = self._server_stats()
        self._offload(
            session,
            msg.req_id,
            lambda: self._stats_with(server),
            lambda s: p.StatsReply(stats=s),
        )

    def _stats_with(self, server: dict[str, int]) -> dict[str, Any]:
        # Bounded: the tenants holding the most, the rest summed as "other" (a reply, not a dump).
        stats = with_tenants(self._engine.stats(), self._tenant_lookups, MAX_TENANTS)
        return {**stats, "server": server}

    # -- listing ---------------------------------------------------------------------------------
    def list_keys(self, session: Session, msg: p.ListKeys) -> None:
        tiers = self._tiers_named(msg.tier)
        limit = max(1, min(msg.limit, MAX_PAGE))
        if msg.order == "use":
            if not msg.tier:  # use orders are per tier: there is no one order across tiers
                raise Refused(p.ErrorCode.INVALID, "list_keys order=use lists one tier; name it (tier=...)")
            self._offload(
                session, msg.req_id, lambda: _keys_by_use(tiers[0], msg, limit), lambda reply: reply
            )
            return
        if msg.order != "key":
            raise Refused(
                p.ErrorCode.INVALID, f"list_keys order {msg.order!r} is unknown; use 'key' or 'use'"
            )

        def job() -> p.Message:
            found: dict[bytes, list[str]] = {}
            for tier in tiers:
                for key in _matching(tier.iter_keys(), msg):
                    raw = key.to_bytes()
                    if raw > msg.cursor:
                        found.setdefault(raw, []).append(tier.name)
            ordered = sorted(found)
            page = ordered[:limit]
            more = len(ordered) > limit
            return p.KeysReply(
                keys=[p.ListedKey(raw, found[raw]) for raw in page],
                next_cursor=page[-1] if more else b"",
            )

        self._offload(session, msg.req_id, job, lambda reply: reply)

    def manifest(self, session: Session, msg: p.GetManifest) -> None:
        fp = parse_fingerprint(msg.fingerprint)

        def job() -> p.Message:
            m = self._engine.manifest(fp)
            return p.ManifestReply(manifest=None if m is None else m.to_dict())

        self._offload(session, msg.req_id, job, lambda reply: reply)

    # -- explain ---------------------------------------------------------------------------------
    def explain(self, session: Session, msg: p.Explain) -> None:
        check_hashes(msg.hashes)
        self._offload(session, msg.req_id, lambda: self._explain(msg), lambda reply: reply)

    def _explain(self, msg: p.Explain) -> p.Message:
        """Per chunk and group: the tier holding it, or why not. Executor; may ask every tier."""
        specs = self._layouts.resolve(msg.groups)
        known = self._layouts.known_fingerprints()
        for tier in self._engine.lower:
            try:
                known.update(fp.raw for fp, _ in tier.iter_manifests())
            except TierCacheError:
                pass  # a failing tier cannot tell; explain with what the others know
        tiers = self._engine.tiers
        entries = []
        for spec in specs:
            others = [Fingerprint(raw) for raw in sorted(known) if raw != spec.fingerprint.raw]
            keys = [spec.key(h) for h in msg.hashes]
            holders = [next((t.name for t in tiers if t.contains(key)), None) for key in keys]
            gone = [key for key, holder in zip(keys, holders) if holder is None]
            notes = iter(self._evictions.get_many(gone))  # one pass over the record for all
            for i, (h, holder) in enumerate(zip(msg.hashes, holders)):
                if holder is not None:
                    entries.append(p.ExplainEntry(i, spec.object_group, holder))
                    continue
                note = next(notes)
                if note is not None:
                    entries.append(
                        p.ExplainEntry(
                            i,
                            spec.object_group,
                            "evicted",
                            tier=note.tier,
                            reason=note.reason,
                            age_s=round(self._evictions.age(note), 3),
                        )
                    )
                    continue
                other = next(
                    (
                        fp
                        for fp in others
                        if any(t.contains(ObjectKey(fp, spec.object_group, h)) for t in tiers)
                    ),
                    None,
                )
                if other is not None:
                    entries.append(
                        p.ExplainEntry(i, spec.object_group, "other_fingerprint", other_fingerprint=other.raw)
                    )
                else:
                    entries.append(p.ExplainEntry(i, spec.object_group, "never_stored"))
        return p.ExplainReply(entries=entries)

    # -- clear and warm --------------------------------------------------------------------------
    def clear(self, session: Session, msg: p.Clear) -> None:
        self._clear(session, msg.req_id, msg.fingerprint, self._engine.tiers, None)

    def clear_batch(self, session: Session, msg: p.ClearBatch) -> None:
        if not 1 <= msg.limit <= MAX_PAGE:
            raise Refused(
                p.ErrorCode.INVALID, f"clear_batch limit {msg.limit} is out of range; use 1 to {MAX_PAGE}"
            )
        self._clear(session, msg.req_id, msg.fingerprint, self._tiers_named(msg.tier), msg.limit)

    def _clear(
        self, session: Session, req_id: int, fingerprint: bytes, tiers: list[Tier], limit: int | None
    ) -> None:
        """Delete the matching keys (at most ``limit``; ``None``: all) from ``tiers``; replies with
        how many keys went from at least one of them."""
        if fingerprint:
            parse_fingerprint(fingerprint)

        def matching(tier: Tier) -> Iterator[ObjectKey]:
            return (k for k in tier.iter_keys() if not fingerprint or k.fingerprint.raw == fingerprint)

        def job() -> p.Message:
            # A batch takes the first ``limit`` matching keys from an iterator (a large disk tier is
            # not listed whole per batch); deleted keys leave ``iter_keys``, so the next batch starts
            # with the next ones.
            batch: dict[ObjectKey, None] = {}
            for tier in tiers:
                remaining = None if limit is None else limit - len(batch)
                if remaining == 0:
                    break
                batch.update(dict.fromkeys(islice(matching(tier), remaining)))
            gone = 0
            for key in batch:
                held = [tier.delete(key) for tier in tiers]  # every tier, not just the first holder
                gone += any(held)
            return p.Done(count=gone)

        self._offload(session, req_id, job, lambda reply: reply)

    def warm(self, session: Session, msg: p.Warm) -> None:
        if len(msg.keys) > MAX_PAGE:
            raise Refused(
                p.ErrorCode.INVALID,
                f"warm takes at most {MAX_PAGE} keys per request, got {len(msg.keys)}; send batches",
            )
        if msg.max_bytes < 0:
            raise Refused(
                p.ErrorCode.INVALID,
                f"warm max_bytes {msg.max_bytes} is negative; use 0 (no limit) or a byte budget",
            )
        keys = [parse_key(raw) for raw in msg.keys]

        def job() -> p.Message:
            reply = p.WarmReply()
            for key in keys:
                if msg.max_bytes and reply.bytes >= msg.max_bytes:
                    break  # budget spent: the rest are left unexamined
                promoted = self._engine.warm(key)
                if promoted is None:
                    reply.failed += 1
                elif promoted == 0:
                    reply.present += 1
                else:
                    reply.promoted += 1
                    reply.bytes += promoted
            return reply

        self._offload(session, msg.req_id, job, lambda reply: reply)

    def _tiers_named(self, name: str) -> list[Tier]:
        """Every tier (``name`` empty) or the one called ``name``; ``invalid`` if there is none."""
        tiers = [t for t in self._engine.tiers if not name or t.name == name]
        if not tiers:
            names = ", ".join(t.name for t in self._engine.tiers)
            raise Refused(p.ErrorCode.INVALID, f"no tier named {name!r}; this server has {names}")
        return tiers


def _matching(keys: Iterator[ObjectKey], msg: p.ListKeys) -> Iterator[ObjectKey]:
    """The keys that pass a list_keys request's fingerprint and group filters."""
    for key in keys:
        if msg.fingerprint and key.fingerprint.raw != msg.fingerprint:
            continue
        if msg.object_group >= 0 and key.object_group != msg.object_group:
            continue
        yield key


def _keys_by_use(tier: Tier, msg: p.ListKeys, limit: int) -> p.Message:
    """A page of ``tier``'s keys, most recently used first; the cursor is how many matching keys
    earlier pages returned (8 bytes, big-endian)."""
    skip = int.from_bytes(msg.cursor, "big") if msg.cursor else 0
    page: list[bytes] = []
    for seen, key in enumerate(_matching(tier.iter_keys_by_use(), msg), start=1):
        if seen <= skip:
            continue
        if len(page) == limit:
            return p.KeysReply(
                keys=[p.ListedKey(k, [tier.name]) for k in page],
                next_cursor=(skip + limit).to_bytes(8, "big"),
            )
        page.append(key.to_bytes())
    return p.KeysReply(keys=[p.ListedKey(k, [tier.name]) for k in page], next_cursor=b"")


__all__ = ["MAX_PAGE", "ManagementOps"]
