"""The residency log: which tier gained or lost which object, numbered, for clients that follow it.

A vLLM connector follows it (:class:`~tiercache.wire.protocol.Events`) to publish KV cache events
for routers: ``BlockStored`` when a chunk it stored lands in a tier, ``BlockRemoved`` when a tier
drops it. Tiers report through :class:`~tiercache.tier.TierStats` listeners (``arrival`` and
``listener``), which run under the tiers' own locks: recording is one append under a private lock.

Bounded (``capacity`` changes, ~110 bytes each measured) and lazy: nothing is recorded until a client first
asks, so a server nobody follows pays one flag check per change. A client that falls more than
``capacity`` changes behind is told (``lost``) instead of being handed a partial story.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Callable, Sequence
from itertools import islice

from tiercache.keys.object_key import ObjectKey
from tiercache.tier import EvictionReason
from tiercache.wire import protocol as p

#: The most changes one :class:`~tiercache.wire.protocol.Events` request may scan.
MAX_EVENTS_PER_REPLY = 10_000


class ResidencyLog:
    """Thread-safe bounded log of residency changes (see the module docstring)."""

    def __init__(self, capacity: int = 262_144, local_tiers: Sequence[str] = ()) -> None:
        if capacity < 1:
            raise ValueError(f"the residency log needs room for at least one change, got {capacity}")
        self.instance = secrets.token_bytes(8)  # tells clients a restarted server from this one
        self._local_tiers = list(local_tiers)  # EventsReply.local_tiers
        self._lock = threading.Lock()
        self._log: deque[tuple[int, p.EventKind, str, ObjectKey]] = deque(maxlen=capacity)  # guarded
        self._last = 0  # seq of the newest change recorded (guarded by _lock)
        self._recording = False  # set by the first read; never cleared

    def stored(self, tier: str) -> Callable[[Sequence[ObjectKey]], None]:
        """The ``arrival`` listener for the tier named ``tier``."""
        return lambda keys: self._add(p.EventKind.STORED, tier, keys)

    def removed(self, tier: str) -> Callable[[Sequence[ObjectKey], EvictionReason], None]:
        """The removal listener for the tier named ``tier`` (every reason is a removal)."""
        return lambda keys, reason: self._add(p.EventKind.REMOVED, tier, keys)

    def _add(self, kind: p.EventKind, tier: str, keys: Sequence[ObjectKey]) -> None:
        if not self._recording:
            return
        with self._lock:
            first = self._last + 1
            self._last += len(keys)
            self._log.extend((seq, kind, tier, key) for seq, key in enumerate(keys, first))

    def read(self, msg: p.Events) -> p.EventsReply:
        """Answer an :class:`~tiercache.wire.protocol.Events` request (in memory; request loop)."""
        limit = min(max(msg.limit, 1), MAX_EVENTS_PER_REPLY)
        wanted = set(msg.fingerprints)
        with self._lock:
            self._recording = True
            if msg.since < 0 or msg.since >= self._last:
                # A start, a caught-up client, or one numbering from a previous server instance.
                return p.EventsReply(
                    instance=self.instance,
                    next_seq=self._last if msg.since < 0 else msg.since,
                    local_tiers=self._local_tiers,
                )
            first = self._log[0][0] if self._log else self._last + 1
            lost = msg.since + 1 < first
            start = max(0, msg.since + 1 - first)
            scanned = list(islice(self._log, start, start + limit))
            last = self._last
        events = [
            p.ResidencyEvent(seq, kind, tier, key.to_bytes())
            for seq, kind, tier, key in scanned
            if not wanted or key.fingerprint.raw in wanted
        ]
        next_seq = scanned[-1][0] if scanned else msg.since
        return p.EventsReply(
            instance=self.instance,
            next_seq=next_seq,
            events=events,
            more=next_seq < last,
            lost=lost,
            local_tiers=self._local_tiers,
        )


def chain_removals(
    *listeners: Callable[[Sequence[ObjectKey], EvictionReason], None],
) -> Callable[[Sequence[ObjectKey], EvictionReason], None]:
    """One removal listener that calls each of ``listeners`` in turn."""

    def removed(keys: Sequence[ObjectKey], reason: EvictionReason) -> None:
        for listener in listeners:
            listener(keys, reason)

    return removed


__all__ = ["MAX_EVENTS_PER_REPLY", "ResidencyLog", "chain_removals"]
