"""KV cache events for routers: which tiers of this node's server hold the chunks and tails this engine stored.

KV-aware routers (llm-d's KV-cache indexer, Dynamo's KV router) place a request on the replica whose
caches hold the longest prefix, learning that from vLLM's KV events (``--kv-events-config``). vLLM
publishes its own GPU blocks; this module adds what tiercache holds, through vLLM's own stream (the
scheduler half's ``take_events()``, merged by vLLM's scheduler into each step's batch):

* ``BlockStored`` for the blocks of each chunk this engine stored, and for the one block of each
  tail (:mod:`tiercache.connector.tails`), once per tier it lands in, with the block hashes, parent
  hash, token ids, LoRA and extra keys vLLM itself publishes for those blocks (so a router hashing
  like vLLM matches them) and ``medium`` naming the tier (:data:`TIER_MEDIA`);
* ``BlockRemoved`` for the same hashes and medium when that tier drops the object (evicted, failed
  verification, deleted by ``tiercache clear``, expired, a tail superseded), except for the blocks
  another object this tracker follows still holds in that tier: a tail and the chunk that covers it
  share a block hash (vLLM's hash names the block's tokens and everything before them), so a tail
  superseded by its chunk, once the chunk is reported there, is no removal at all.

A router folds these events into a set of (block hash, medium) per replica; what the tracker
publishes keeps that set equal to what the tiers hold, as of the last change of the log it has
read. Removals are therefore decided once per ``take()``, after every change read in it: a
tail's removal and its chunk's arrival in one batch, in either order, publish no removal; a
removal read before the chunk's arrival is reported (a later batch) is published, and the
chunk's ``BlockStored`` announces the block again when it comes (the disk's copy of a chunk
lands after the commit that superseded its tails from the disk, so ``DISK`` does that).

The server keeps a residency log (:mod:`tiercache.server.events`); this tracker follows it every
``kv_events_interval_s`` with one asynchronous request (never waiting on the engine loop), for the
anchor object of each chunk and tail (the first full-attention object group: present for every
stored one).

What it cannot know, it retracts rather than leave a router routing to KV that may be gone: the
oldest objects beyond ``kv_events_chunks`` chunks' worth of blocks (a tail counts its one block)
are published as removed when forgotten; after a server restart its L1 medium is removed for every
object; a gap in the log (this engine fell behind the server's bounded log) removes every medium of
every object. Those removals too spare only blocks another followed object still holds.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tiercache.client.client import Client
from tiercache.config.connector import ConnectorSettings
from tiercache.errors import ProtocolError, TierCacheError
from tiercache.keys import Fingerprint, ObjectKey
from tiercache.wire import protocol as p

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
class _Object:
    """What one stored object's events say (as vLLM would publish its blocks), and which media hold
    it: a chunk's blocks, or a tail's one block."""

    block_hashes: list[Any]
    parent: Any
    token_ids: array[int]  # 8 bytes a token (a list of ints costs ~36)
    block_size: int
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[Any] | None
    #: Where the blocks lie: the hash of the first block of the chunk they are in (a chunk's own
    #: first block; for a tail, its chunk's), and the position of ``block_hashes[0]`` in that chunk.
    chunk_first: Any
    offset: int
    media: set[str] = field(default_factory=set)

    def hashes_at(self) -> list[tuple[int, Any]]:
        """``(position in the chunk, block hash)`` of each block."""
        return [(self.offset + i, h) for i, h in enumerate(self.block_hashes)]


@dataclass(slots=True)
class _Holdings:
    """The objects and media a snapshot names (:meth:`KVEventTracker.holdings`): references copied
    under the tracker's lock; an object's blocks, hashes and token ids never change once kept."""

    held: list[tuple[_Object, str, str]]  # (object, tier, medium)

    def events(self, per_batch: int) -> Iterator[list[Any]]:
        """``BlockStored`` for every object and medium held, ``per_batch`` at a time."""
        for i in range(0, len(self.held), per_batch):
            yield [
                KVEventTracker._stored(obj, tier, medium)
                for obj, tier, medium in self.held[i : i + per_batch]
            ]


class KVEventTracker:
    """See the module docstring. Every method runs on the engine loop thread, except
    :meth:`on_connect` (the link's), which only hands a position over to the next :meth:`take`,
    and :meth:`holdings` (a feed's thread, under :attr:`lock`)."""

    def __init__(self, settings: ConnectorSettings, block_size: int) -> None:
        #: Guards every field below against :meth:`holdings`, which a feed's thread calls; the
        #: engine loop holds it for each :meth:`take` and each object kept (uncontended then).
        self.lock = threading.Lock()
        #: Where :meth:`take`'s events go instead of its return value (a feed's ``publish``, called
        #: under :attr:`lock`); None: they go to vLLM's stream.
        self._sink: Callable[[list[Any]], None] | None = None
        self._interval = settings.kv_events_interval_s
        self._capacity = settings.kv_events_chunks  # in chunks' worth of blocks (see remember)
        self._block_size = block_size
        self._anchor: tuple[Fingerprint, int] | None = None
        self._objects: OrderedDict[bytes, _Object] = OrderedDict()  # anchor key bytes → object, oldest first
        #: The keys of the objects whose blocks lie in the chunk starting with this block hash (the
        #: chunk and its tails): where to look for another holder of a block being removed.
        self._by_chunk: dict[Any, list[bytes]] = {}
        self._blocks = 0  # blocks of the objects in _objects
        self._gone: list[tuple[_Object, str, str]] = []  # (object, tier, medium) dropped, to publish
        self._out: list[Any] = []  # events for the next take()
        self._instance: bytes | None = None
        self._cursor = -1  # -1: ask the server for its position first
        self._pending = 0  # request id of the events request in flight (0: none)
        self._next_at = 0.0
        self._connected: tuple[bytes, int] | None = None  # (instance, position) from on_connect
        self._unconfirmed: dict[bytes, float] = {}  # stored objects not yet reported everywhere → deadline
        #: The media every stored object lands in (the server's ``local_tiers``); an object is
        #: confirmed once all of them reported it (by the first report, from an older server).
        self._expected: set[str] = set()
        self.counts = {
            "stored_events": 0,
            "removed_events": 0,
            "retracted_chunks": 0,  # objects forgotten beyond the bound (chunks and tails)
            "covered_blocks": 0,  # removed blocks not published: another followed object holds them there
        }

    @property
    def enabled(self) -> bool:
        return self._interval > 0

    def publish_to(self, sink: Callable[[list[Any]], None]) -> None:
        """Hand each :meth:`take`'s events to ``sink`` (under :attr:`lock`) and return none to vLLM."""
        self._sink = sink

    def holdings(self) -> _Holdings:
        """What the events published so far say is held, object by object and medium by medium
        (the caller holds :attr:`lock`): the media of each followed object, and those of objects
        dropped whose removal the next :meth:`take` publishes. O(objects), references only."""
        held = [
            (obj, tier, medium)
            for obj in self._objects.values()
            for tier, medium in TIER_MEDIA.items()
            if medium in obj.media
        ]
        held.extend(self._gone)
        return _Holdings(held)

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
        start = chunk * chunk_size
        self._keep(request, prefix_hash, start, start + chunk_size, start, chunk_size)

    def remember_tail(
        self, request: Any, chunk: int, chunk_size: int, j: int, tail_size: int, prefix_hash: bytes
    ) -> None:
        """A store of tail ``j`` (``tail_size`` tokens) of ``request``'s chunk ``chunk`` was planned,
        under ``prefix_hash`` (its tail hash): keep what its events will say."""
        start = chunk * chunk_size + j * tail_size
        self._keep(request, prefix_hash, start, start + tail_size, chunk * chunk_size, chunk_size)

    def _keep(
        self, request: Any, prefix_hash: bytes, start: int, end: int, chunk_start: int, chunk_size: int
    ) -> None:
        with self.lock:
            self._keep_locked(request, prefix_hash, start, end, chunk_start, chunk_size)

    def _keep_locked(
        self, request: Any, prefix_hash: bytes, start: int, end: int, chunk_start: int, chunk_size: int
    ) -> None:
        """Keep the events of the object ``prefix_hash`` holding tokens ``start .. end - 1`` of
        ``request``, inside the chunk starting at token ``chunk_start``."""
        size = self._block_size
        if not self.enabled or self._anchor is None or size < 1 or start % size or end % size:
            return
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            maybe_convert_block_hash,
            to_event_extra_keys,
        )

        first, count = start // size, (end - start) // size
        hashes = list(getattr(request, "block_hashes", ()) or ())
        if count < 1 or len(hashes) < first + count:
            return  # vLLM has not hashed these blocks (nothing a router could match)
        fingerprint, group = self._anchor
        key = ObjectKey(fingerprint, group, prefix_hash).to_bytes()
        held = self._objects.get(key)
        if held is not None:  # stored again (the same blocks): keep what the tiers reported
            self._objects.move_to_end(key)
            if not (self._expected and self._expected <= held.media):
                self._unconfirmed[key] = time.monotonic() + CONFIRM_WITHIN_S
            return
        self._unconfirmed[key] = time.monotonic() + CONFIRM_WITHIN_S
        extra = [
            generate_block_hash_extra_keys(request, start + i * size, start + (i + 1) * size, 0)[0]
            for i in range(count)
        ]
        lora = getattr(request, "lora_request", None)
        obj = _Object(
            block_hashes=[maybe_convert_block_hash(h) for h in hashes[first : first + count]],
            parent=maybe_convert_block_hash(hashes[first - 1]) if first > 0 else None,
            token_ids=array("q", request.all_token_ids[start:end]),
            block_size=size,
            lora_id=lora.adapter_id if lora is not None else None,
            lora_name=lora.name if lora is not None else None,
            extra_keys=to_event_extra_keys(extra),
            chunk_first=maybe_convert_block_hash(hashes[chunk_start // size]),
            offset=first - chunk_start // size,
        )
        self._objects[key] = obj
        self._by_chunk.setdefault(obj.chunk_first, []).append(key)
        self._blocks += count
        limit = self._capacity * max(1, chunk_size // size)
        while self._blocks > limit:
            old_key, old = next(iter(self._objects.items()))
            self._forget(old_key, old)
            self._drop_all(old)
            self._unconfirmed.pop(old_key, None)
            self.counts["retracted_chunks"] += 1

    def _forget(self, key: bytes, obj: _Object) -> None:
        del self._objects[key]
        self._blocks -= len(obj.block_hashes)
        keys = self._by_chunk[obj.chunk_first]
        keys.remove(key)
        if not keys:
            del self._by_chunk[obj.chunk_first]

    # -- following the server ------------------------------------------------------------------
    def busy(self) -> bool:
        """Whether objects this engine stored are still to be reported by a local tier they land
        in (L1, and the disk by write-behind; for at most :data:`CONFIRM_WITHIN_S` each: a dropped
        store never is). vLLM calls ``take_events()`` only while its engine steps, so the
        connector keeps it stepping until then: an idle engine would otherwise publish a chunk's
        ``DISK`` copy only at its next request."""
        if not self._unconfirmed:
            return False
        now = time.monotonic()
        for key in [k for k, deadline in self._unconfirmed.items() if deadline <= now]:
            del self._unconfirmed[key]
        return bool(self._unconfirmed)

    def take(self, client: Client | None) -> list[Any]:
        """The events gathered since the last call; sends or collects the next request (never waits).
        With a sink (:meth:`publish_to`) they go there and none are returned."""
        with self.lock:
            if self.enabled and client is not None and self._anchor is not None:
                try:
                    self._follow(client)
                except TierCacheError as exc:  # the next request retries; the link notices outages
                    log.debug("tiercache: following the server's residency log failed: %s", exc)
                    self._pending = 0
            self._publish_removals()
            out, self._out = self._out, []
            if self._sink is None:
                return out
            if out:
                self._sink(out)
            return []

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
        self._expected = {TIER_MEDIA.get(t, t.upper()) for t in reply.local_tiers}
        if reply.lost:
            log.warning(
                "tiercache: fell behind the server's residency log; publishing every chunk as removed "
                "(a router relearns them as they are stored again)"
            )
            self._retract()
        self._cursor = reply.next_seq
        for event in reply.events:
            obj = self._objects.get(event.key)
            if obj is None:
                continue  # another engine's store (same layout): it publishes its own
            medium = TIER_MEDIA.get(event.tier, event.tier.upper())
            if event.kind is p.EventKind.STORED and medium not in obj.media:
                obj.media.add(medium)
                self._out.append(self._stored(obj, event.tier, medium))
                self.counts["stored_events"] += 1
            if event.kind is p.EventKind.STORED and self._expected <= obj.media:
                self._unconfirmed.pop(event.key, None)
            elif event.kind is p.EventKind.REMOVED and medium in obj.media:
                self._drop(obj, event.tier, medium)

    def _retract(self, only: str | None = None) -> None:
        for obj in self._objects.values():
            self._drop_all(obj, only)

    def _drop_all(self, obj: _Object, only: str | None = None) -> None:
        for tier, medium in TIER_MEDIA.items():
            if medium in obj.media and (only is None or tier == only):
                self._drop(obj, tier, medium)

    def _drop(self, obj: _Object, tier: str, medium: str) -> None:
        """``medium`` no longer holds ``obj``: its blocks are published as removed by the next
        :meth:`_publish_removals`, those no other object holds there by then."""
        obj.media.discard(medium)
        self._gone.append((obj, tier, medium))

    def _holds(self, chunk_first: Any, at: int, block_hash: Any, medium: str) -> bool:
        """Whether an object this tracker follows holds, in ``medium``, block ``at`` (``block_hash``)
        of the chunk starting with block ``chunk_first``: the chunk itself or one of its tails."""
        for key in self._by_chunk.get(chunk_first, ()):
            obj = self._objects[key]
            i = at - obj.offset
            if medium in obj.media and 0 <= i < len(obj.block_hashes) and obj.block_hashes[i] == block_hash:
                return True
        return False

    def _publish_removals(self) -> None:
        """Publish the removals gathered since the last call: for each dropped object and medium,
        its blocks that no followed object holds there now (each once)."""
        gone, self._gone = self._gone, []
        published: set[tuple[str, Any]] = set()
        for obj, tier, medium in gone:
            hashes = []
            for at, h in obj.hashes_at():
                if (medium, h) in published:
                    continue
                if self._holds(obj.chunk_first, at, h, medium):
                    self.counts["covered_blocks"] += 1
                    continue
                published.add((medium, h))
                hashes.append(h)
            if hashes:
                self._out.append(self._removed(hashes, tier, medium))
                self.counts["removed_events"] += 1

    @staticmethod
    def _stored(obj: _Object, tier: str, medium: str) -> Any:
        from vllm.distributed.kv_events import BlockStored

        return BlockStored(
            block_hashes=obj.block_hashes,
            parent_block_hash=obj.parent,
            token_ids=obj.token_ids.tolist(),
            block_size=obj.block_size,
            lora_id=obj.lora_id,
            medium=medium,
            lora_name=obj.lora_name,
            extra_keys=obj.extra_keys,
            locality=TIER_LOCALITY.get(tier),
        )

    @staticmethod
    def _removed(block_hashes: list[Any], tier: str, medium: str) -> Any:
        from vllm.distributed.kv_events import BlockRemoved

        return BlockRemoved(block_hashes=block_hashes, medium=medium, locality=TIER_LOCALITY.get(tier))


__all__ = ["TIER_LOCALITY", "TIER_MEDIA", "KVEventTracker"]
