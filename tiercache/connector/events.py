"""KV cache events for routers: which tiers of this node's server hold the chunks this engine stored.

KV-aware routers (llm-d's KV-cache indexer, Dynamo's KV router) place a request on the replica whose
caches hold the longest prefix, learning that from vLLM's KV events (``--kv-events-config``). vLLM
publishes its own GPU blocks; this module adds what tiercache holds, through vLLM's own stream (the
scheduler half's ``take_events()``, merged by vLLM's scheduler into each step's batch):

* ``BlockStored`` for the blocks of each chunk this engine stored, once per tier it lands in, with
  the block hashes, parent hash, token ids, LoRA and extra keys vLLM itself publishes for those
  blocks (so a router hashing like vLLM matches them) and ``medium`` naming the tier
  (:data:`TIER_MEDIA`);
* ``BlockRemoved`` for the same hashes and medium when that tier drops the chunk (evicted, failed
  verification, deleted by ``tiercache clear``, expired); once every tier has, the router holds
  nothing of it for this replica.

The server keeps a residency log (:mod:`tiercache.server.events`); this tracker follows it every
``kv_events_interval_s`` with one asynchronous request (never waiting on the engine loop), for the
anchor object of each chunk (the first full-attention object group: present for every stored chunk).

What it cannot know, it retracts rather than leave a router routing to KV that may be gone: chunks
beyond ``kv_events_chunks`` are published as removed when forgotten; after a server restart its L1
medium is removed for every chunk; a gap in the log (this engine fell behind the server's bounded
log) removes every medium of every chunk.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from tiercache.config.connector import ConnectorSettings
from tiercache.errors import ProtocolError, TierCacheError
from tiercache.keys import Fingerprint, ObjectKey
from tiercache.wire import protocol as p
from tiercache.wire.client import Client

log = logging.getLogger(__name__)

#: The ``medium`` of each tier's events. ``CPU`` is vLLM's own name for host memory (its
#: OffloadingConnector's CPU tier uses it too); the lower tiers are named for what they are.
TIER_MEDIA = {"l1": "CPU", "disk": "DISK", "s3": "S3"}
#: ``locality`` of each tier's events: S3 is shared by every node, not this replica's own.
TIER_LOCALITY = {"l1": "LOCAL", "disk": "LOCAL", "s3": "REMOTE"}
#: How long a stored chunk keeps the engine stepping while no tier has reported it (a store the
#: server dropped, L1 full, is never reported).
CONFIRM_WITHIN_S = 5.0


@dataclass(slots=True)
class _Chunk:
    """What a chunk's events say (as vLLM would publish its blocks), and which media hold it."""

    block_hashes: list[Any]
    parent: Any
    token_ids: array[int]  # 8 bytes a token (a list of ints costs ~36)
    block_size: int
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[Any] | None
    media: set[str] = field(default_factory=set)


class KVEventTracker:
    """See the module docstring. Every method runs on the engine loop thread, except
    :meth:`on_connect` (the link's), which only hands a position over to the next :meth:`take`."""

    def __init__(self, settings: ConnectorSettings, block_size: int) -> None:
        self._interval = settings.kv_events_interval_s
        self._capacity = settings.kv_events_chunks
        self._block_size = block_size
        self._anchor: tuple[Fingerprint, int] | None = None
        self._chunks: OrderedDict[bytes, _Chunk] = OrderedDict()  # anchor key bytes → chunk
        self._out: list[Any] = []  # events for the next take()
        self._instance: bytes | None = None
        self._cursor = -1  # -1: ask the server for its position first
        self._pending = 0  # request id of the events request in flight (0: none)
        self._next_at = 0.0
        self._connected: tuple[bytes, int] | None = None  # (instance, position) from on_connect
        self._unconfirmed: dict[bytes, float] = {}  # stored chunks no tier reported yet → deadline
        self.counts = {"stored_events": 0, "removed_events": 0, "retracted_chunks": 0}

    @property
    def enabled(self) -> bool:
        return self._interval > 0

    def use_anchor(self, fingerprint: Fingerprint, object_group: int) -> None:
        """Follow the objects of this group (the layout's first full-attention group)."""
        self._anchor = (fingerprint, object_group)

    def on_connect(self, client: Client) -> None:
        """(Re)connected: learn the server's position before this engine stores anything (the
        server records changes from the first request on). One round trip."""
        if not self.enabled:
            return
        try:
            reply = client.events()
        except ProtocolError as exc:  # a server from before the residency log: no events, still a cache
            log.warning(
                "tiercache: the server cannot report what its tiers hold (%s); publishing no KV events", exc
            )
            self._interval = 0.0
            return
        self._connected = (reply.instance, reply.next_seq)  # one assignment: taken by take()
        log.info(
            "tiercache: publishing KV events for routers every %g s (media %s)",
            self._interval,
            ", ".join(TIER_MEDIA.values()),
        )

    def _adopt(self, instance: bytes) -> None:
        if self._instance is not None and instance != self._instance:
            log.info("tiercache: the server restarted; publishing its L1 copies as removed")
            self._retract(only="l1")
        self._instance = instance

    # -- what was stored -----------------------------------------------------------------------
    def remember(self, request: Any, chunk: int, chunk_size: int, prefix_hash: bytes) -> None:
        """A store of ``request``'s chunk ``chunk`` was planned: keep what its events will say."""
        if not self.enabled or self._anchor is None:
            return
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            maybe_convert_block_hash,
            to_event_extra_keys,
        )

        size = self._block_size
        first, count = chunk * chunk_size // size, chunk_size // size
        hashes = list(getattr(request, "block_hashes", ()) or ())
        if count < 1 or len(hashes) < first + count:
            return  # vLLM has not hashed these blocks (nothing a router could match)
        start = chunk * chunk_size
        extra = [
            generate_block_hash_extra_keys(request, start + i * size, start + (i + 1) * size, 0)[0]
            for i in range(count)
        ]
        lora = getattr(request, "lora_request", None)
        fingerprint, group = self._anchor
        key = ObjectKey(fingerprint, group, prefix_hash).to_bytes()
        self._chunks[key] = _Chunk(
            block_hashes=[maybe_convert_block_hash(h) for h in hashes[first : first + count]],
            parent=maybe_convert_block_hash(hashes[first - 1]) if first > 0 else None,
            token_ids=array("q", request.all_token_ids[start : start + chunk_size]),
            block_size=size,
            lora_id=lora.adapter_id if lora is not None else None,
            lora_name=lora.name if lora is not None else None,
            extra_keys=to_event_extra_keys(extra),
        )
        self._chunks.move_to_end(key)
        self._unconfirmed[key] = time.monotonic() + CONFIRM_WITHIN_S
        while len(self._chunks) > self._capacity:
            _, old = self._chunks.popitem(last=False)
            self._remove_all(old)
            self.counts["retracted_chunks"] += 1

    # -- following the server ------------------------------------------------------------------
    def busy(self) -> bool:
        """Whether chunks this engine stored are still to be reported by a tier (for at most
        :data:`CONFIRM_WITHIN_S` each: a dropped store never is). vLLM calls ``take_events()``
        only while its engine steps, so the connector keeps it stepping until then."""
        if not self._unconfirmed:
            return False
        now = time.monotonic()
        for key in [k for k, deadline in self._unconfirmed.items() if deadline <= now]:
            del self._unconfirmed[key]
        return bool(self._unconfirmed)

    def take(self, client: Client | None) -> list[Any]:
        """The events gathered since the last call; sends or collects the next request (never waits)."""
        if self.enabled and client is not None and self._anchor is not None:
            try:
                self._follow(client)
            except TierCacheError as exc:  # the next request retries; the link notices outages
                log.debug("tiercache: following the server's residency log failed: %s", exc)
                self._pending = 0
        out, self._out = self._out, []
        return out

    def _follow(self, client: Client) -> None:
        connected, self._connected = self._connected, None
        if connected is not None:  # follow the (new) server from where it stood at connect
            self._adopt(connected[0])
            self._cursor, self._pending = connected[1], 0
        if self._pending:
            reply = client.poll(self._pending)
            if reply is None:
                return
            self._pending = 0
            self._apply(reply)
            if not reply.more:
                self._next_at = time.monotonic() + self._interval
        if not self._pending and time.monotonic() >= self._next_at:
            assert self._anchor is not None
            self._pending = client.events_async(self._cursor, [self._anchor[0]])

    def _apply(self, reply: p.EventsReply) -> None:
        if self._instance is not None and reply.instance != self._instance:
            self._adopt(reply.instance)
            self._cursor = -1  # numbering restarts: take the new server's position first
            return
        self._instance = reply.instance
        if reply.lost:
            log.warning(
                "tiercache: fell behind the server's residency log; publishing every chunk as removed "
                "(a router relearns them as they are stored again)"
            )
            self._retract()
        self._cursor = reply.next_seq
        for event in reply.events:
            chunk = self._chunks.get(event.key)
            if chunk is None:
                continue  # another engine's store (same layout): it publishes its own
            medium = TIER_MEDIA.get(event.tier, event.tier.upper())
            if event.kind is p.EventKind.STORED and medium not in chunk.media:
                chunk.media.add(medium)
                self._unconfirmed.pop(event.key, None)
                self._out.append(self._stored(chunk, event.tier, medium))
                self.counts["stored_events"] += 1
            elif event.kind is p.EventKind.REMOVED and medium in chunk.media:
                self._publish_removal(chunk, event.tier, medium)

    def _retract(self, only: str | None = None) -> None:
        for chunk in self._chunks.values():
            self._remove_all(chunk, only)

    def _remove_all(self, chunk: _Chunk, only: str | None = None) -> None:
        for tier, medium in TIER_MEDIA.items():
            if medium in chunk.media and (only is None or tier == only):
                self._publish_removal(chunk, tier, medium)

    def _publish_removal(self, chunk: _Chunk, tier: str, medium: str) -> None:
        chunk.media.discard(medium)
        self._out.append(self._removed(chunk, tier, medium))
        self.counts["removed_events"] += 1

    @staticmethod
    def _stored(chunk: _Chunk, tier: str, medium: str) -> Any:
        from vllm.distributed.kv_events import BlockStored

        return BlockStored(
            block_hashes=chunk.block_hashes,
            parent_block_hash=chunk.parent,
            token_ids=chunk.token_ids.tolist(),
            block_size=chunk.block_size,
            lora_id=chunk.lora_id,
            medium=medium,
            lora_name=chunk.lora_name,
            extra_keys=chunk.extra_keys,
            locality=TIER_LOCALITY.get(tier),
        )

    @staticmethod
    def _removed(chunk: _Chunk, tier: str, medium: str) -> Any:
        from vllm.distributed.kv_events import BlockRemoved

        return BlockRemoved(block_hashes=chunk.block_hashes, medium=medium, locality=TIER_LOCALITY.get(tier))


__all__ = ["TIER_LOCALITY", "TIER_MEDIA", "KVEventTracker"]
