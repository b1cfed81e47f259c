"""Lookup: the longest restorable prefix of a chain of chunk hashes across all tiers.

At a boundary of ``T`` chunks every full-attention group needs all chunks before ``T``, every
sliding-window group the chunks of its trailing window, every recurrent group the state snapshot
stored under chunk ``T-1`` (:mod:`tiercache.keys.restore`). A hit is reported only when *all* groups
are satisfied. Local tiers are asked in batches (one call per tier for all of a group's chunks);
remote tiers (S3) by search, a run of keys at a time, only for what the local tiers lack, on workers
of their own and within the lookup's budget (:mod:`tiercache.engine.remote`).

Asked with ``inflight=True``, an object whose bytes are being written into the front tier (an open
L1 reservation: another engine's store, or a promotion) counts as present, under the front tier: the
caller then waits for its commit (:mod:`tiercache.engine.promotion`) instead of reporting a miss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

from tiercache.engine.groups import GroupSpec
from tiercache.engine.remote import RemoteAsker, RemoteBudget
from tiercache.keys.fingerprint import GroupKind
from tiercache.keys.object_key import ObjectKey
from tiercache.tier.contract import FrontTier, HeldSet, Tier

_INFLIGHT = "inflight"  # where-marker of an object being written into the front tier


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The longest restorable prefix, in chunks, and where its objects live.

    ``per_tier`` counts the needed objects by the highest tier holding each one (``"l1"``, ``"disk"``,
    ``"s3"``), so a caller can report hits per tier; ``inflight`` of those counted under the front
    tier are still being written there (only with ``inflight=True``). ``keys`` are those needed
    objects' keys (each once), for a prefetch of the same ``chunks`` to pin without building them
    again.
    """

    chunks: int
    per_tier: dict[str, int]
    inflight: int = 0
    keys: tuple[ObjectKey, ...] = field(default=(), compare=False, repr=False)


class Locator:
    """Answers lookups over ``tiers`` (fastest first). Stateless between calls; thread-safe as the
    tiers are. Blocking: local tiers may read LMDB; remote ones are asked through ``remote``, on its
    own workers and within its budget (:mod:`tiercache.engine.remote`)."""

    def __init__(self, tiers: Sequence[Tier], remote: RemoteAsker) -> None:
        self._tiers = list(tiers)
        self._asker = remote
        self._remote = [t for t in self._tiers if t.remote]
        self._front = self._tiers[0] if self._tiers and isinstance(self._tiers[0], FrontTier) else None

    def lookup(
        self, hashes: Sequence[bytes], groups: Sequence[GroupSpec], *, inflight: bool = False
    ) -> LookupResult:
        """Longest restorable prefix of ``hashes`` for all ``groups`` (all-or-nothing); with
        ``inflight``, objects being written into the front tier count (see the module docstring)."""
        if not groups or not hashes:
            return LookupResult(0, {})
        where: dict[ObjectKey, str] = {}
        remote = self._asker.session()
        boundary = len(hashes)
        full: list[list[ObjectKey]] = []
        for g in groups:
            if g.kind is GroupKind.FULL_ATTENTION:
                full.append(g.needed(hashes, boundary))
                boundary = self._present_prefix(full[-1], where, inflight, remote)
        partial = [g for g in groups if g.kind is not GroupKind.FULL_ATTENTION]
        partial_keys: list[ObjectKey] = []
        while boundary > 0 and partial:
            partial_keys = [k for g in partial for k in g.needed(hashes, boundary)]
            if self._present(partial_keys, where, inflight, remote):
                break
            boundary -= 1
        if boundary == 0:
            return LookupResult(0, {})
        counts: dict[str, int] = {}
        needed = [k for keys in full for k in keys[:boundary]] + partial_keys
        for key in needed:
            counts[where[key]] = counts.get(where[key], 0) + 1
        writing = counts.pop(_INFLIGHT, 0)
        if writing and self._front is not None:
            counts[self._front.name] = counts.get(self._front.name, 0) + writing
        return LookupResult(boundary, counts, writing, tuple(dict.fromkeys(needed)))

    def lookup_front(self, hashes: Sequence[bytes], groups: Sequence[GroupSpec]) -> LookupResult | None:
        """:meth:`lookup`'s answer when the front tier alone gives it, else ``None`` (ask
        :meth:`lookup`): when the front tier holds, committed, every object every group needs to
        restore all of ``hashes``, the hit is the whole chain and no other tier is asked (as
        :meth:`lookup` would not). Never blocks: a request loop may call it (the front tier never
        does I/O). Each group's object of the last chunk is asked first, so a chain the front tier
        does not end with costs a few keys, not all of them; the keys are asked in their binary
        form, and the result's are the front tier's own (none is built)."""
        front, needed = self._front, self._front_needed(hashes, groups)
        if front is None or needed is None:
            return None
        keys = front.committed_keys(list(dict.fromkeys(needed)))
        if not all(keys):  # (a key is always true: no Python call per key, as ``None in`` makes)
            return None
        return LookupResult(len(hashes), {front.name: len(needed)}, 0, tuple(keys))  # type: ignore[arg-type]  # all() found each

    def hold_front(
        self, hashes: Sequence[bytes], groups: Sequence[GroupSpec]
    ) -> tuple[LookupResult, HeldSet, list[bytes]] | None:
        """:meth:`lookup_front`'s answer, with every object of the hit held in the front tier as
        one pin (:meth:`FrontTier.pin_all <tiercache.tier.FrontTier.pin_all>`), and those
        objects' binary keys; ``None`` where :meth:`lookup_front` would say ``None`` (nothing is
        then held). One pass over the front tier's index instead of a lookup's and a pin's. The
        result names no keys (none is built)."""
        # Unprobed: the pin reads the chain's last object first, so a miss costs the keys' bytes
        # and one read, not a lock round of its own.
        front, needed = self._front, self._front_needed(hashes, groups, probe=False)
        if front is None or needed is None:
            return None
        raws = list(dict.fromkeys(needed))
        held = front.pin_all(raws)
        if held is None:
            return None
        return LookupResult(len(hashes), {front.name: len(needed)}, 0), held, raws

    def _front_needed(
        self, hashes: Sequence[bytes], groups: Sequence[GroupSpec], *, probe: bool = True
    ) -> list[bytes] | None:
        """The binary keys of every object ``groups`` need to restore all of ``hashes`` (a key
        may repeat), or ``None`` when there is no front tier or (``probe``) it lacks a group's
        object of the last chunk: asked first, so a chain the front tier does not end with costs
        a few keys, not all of them."""
        front = self._front
        if front is None or not groups or not hashes:
            return None
        if probe and not all(front.committed_keys([r for g in groups for r in g.needed_raw(hashes[-1:], 1)])):
            return None
        n = len(hashes)
        if len(groups) == 1:
            return groups[0].needed_raw(hashes, n)
        return [r for g in groups for r in g.needed_raw(hashes, n)]

    def _locate(self, keys: Sequence[ObjectKey], where: dict[ObjectKey, str], inflight: bool) -> None:
        """Record in ``where`` the fastest *local* tier holding each key, one batched call per tier
        (one lock on L1, one read transaction on LMDB); with ``inflight``, then the keys being
        written into the front tier."""
        pending = [k for k in dict.fromkeys(keys) if k not in where]
        for tier in self._tiers:
            if not pending or tier.remote:
                continue
            found = tier.contains_many(pending)
            for key, hit in zip(pending, found, strict=True):
                if hit:
                    where[key] = tier.name
            pending = [k for k, hit in zip(pending, found, strict=True) if not hit]
        if inflight and pending and self._front is not None:
            for key, writing in zip(pending, self._front.writing_many(pending), strict=True):
                if writing:
                    where[key] = _INFLIGHT

    def _present_prefix(
        self, keys: Sequence[ObjectKey], where: dict[ObjectKey, str], inflight: bool, remote: RemoteBudget
    ) -> int:
        """How many leading ``keys`` some tier holds; fills ``where`` (remote finds included)."""
        self._locate(keys, where, inflight)
        i = 0
        while i < len(keys):
            if keys[i] in where:
                i += 1
                continue
            # A remote tier answers a whole run with a search instead of one request per chunk.
            run = 0
            for tier in self._remote:
                run = remote.ask(partial(tier.lookup_prefix, keys[i:]), 0)
                if run:
                    for key in keys[i : i + run]:
                        where.setdefault(key, tier.name)
                    break
            if run == 0:
                break
            i += run
        return i

    def _present(
        self, keys: Sequence[ObjectKey], where: dict[ObjectKey, str], inflight: bool, remote: RemoteBudget
    ) -> bool:
        """Whether every key is held by some tier (asking remote tiers key by key, cached)."""
        self._locate(keys, where, inflight)
        for key in keys:
            if key in where:
                continue
            tier = next((t for t in self._remote if remote.ask(partial(t.contains, key), False)), None)
            if tier is None:
                return False
            where[key] = tier.name
        return True
