"""The connector's own KV-event feed: what this replica's tiers hold, as a numbered snapshot for a
router that starts or restarts, and the live events after it with no gap and no duplicate.

vLLM's publisher (``--kv-events-config``) numbers its batches and replays the last
``buffer_steps`` of them, but a router that starts later, or loses more than that, cannot learn
what the node's L1, disk and S3 already hold. With ``kv_events_endpoint`` and
``kv_events_replay_endpoint`` set, the connector publishes its tier events (the ``CPU``, ``DISK``
and ``S3`` media of :mod:`tiercache.connector.events`) here instead of into vLLM's stream, framed
as vLLM frames its own so a router reads both with one decoder:

* PUB ``kv_events_endpoint``: ``(topic, seq, payload)``; ``seq`` 8 bytes big-endian, from 0 up by
  one per batch; ``payload`` a msgpack ``KVEventBatch`` exactly as vLLM encodes one.
* ROUTER ``kv_events_replay_endpoint``, asked from a DEALER socket (``(b"", body)``):

  - ``body`` 8 bytes big-endian ``start`` (vLLM's replay request): the buffered batches with
    ``seq >= start`` as ``(b"", topic, seq, payload)``, then the end marker
    ``(b"", b"", -1, b"")``. The first replayed ``seq`` says whether the buffer reached back that
    far (if not, take a snapshot).
  - ``body`` ``b"snapshot"``: ``(b"", topic, next, payload)`` batches of ``BlockStored`` events
    naming every block and medium held, then ``(b"", b"", -1, next)``. The snapshot is exactly
    the fold of every batch with ``seq < next``: apply the live batches from ``next`` on.

The snapshot is taken under the tracker's lock after every batch already taken has been sent
(:meth:`HoldingsFeed._snapshot`), so no batch is both in it and after it. Building and sending it
happen outside that lock: the engine loop waits only for the copy of the tracker's references.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import zmq

from tiercache.config.connector import ConnectorSettings
from tiercache.connector.events import KVEventTracker
from tiercache.errors import ConfigError

log = logging.getLogger(__name__)

#: The body of a snapshot request on the replay socket.
SNAPSHOT_REQUEST = b"snapshot"
#: vLLM's end-of-replay marker (a signed -1 where a sequence number would be).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: ``BlockStored`` events per snapshot message (a few MiB each at 16-block chunks).
SNAPSHOT_BATCH = 4096
#: How long one message of a reply may wait for a slow router before the reply is abandoned.
SEND_TIMEOUT_MS = 5000


class Holdings(Protocol):
    """What a snapshot names, copied under the tracker's lock and built into events outside it."""

    def events(self, per_batch: int) -> Iterator[list[Any]]:
        """``BlockStored`` events for every block and medium held, ``per_batch`` at a time."""
        ...


@dataclass(frozen=True, slots=True)
class FeedEndpoints:
    """Where the feed listens (both are bound) and what it keeps."""

    endpoint: str
    replay_endpoint: str
    topic: str = ""
    buffer_batches: int = 10_000


class HoldingsFeed:
    """Publishes the tracker's batches and answers replay and snapshot requests, on a thread of
    its own (ZMQ sockets stay on it). :meth:`publish` runs on the engine loop, under ``lock``."""

    def __init__(
        self,
        endpoints: FeedEndpoints,
        capture: Callable[[], Holdings],
        lock: threading.Lock,
        data_parallel_rank: int = 0,
    ) -> None:
        self._capture = capture  # called under _lock
        self._lock = lock  # the tracker's: taking and snapshotting exclude each other
        self._rank = data_parallel_rank
        self._topic = endpoints.topic.encode()
        self._queue: queue.SimpleQueue[list[Any] | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=endpoints.buffer_batches)  # feed thread
        self._next = 0  # the seq of the next batch (feed thread; read under _lock by _snapshot)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._router = self._ctx.socket(zmq.ROUTER)
        # A reply is never cut short silently: a router too slow to take it blocks the send (up to
        # SEND_TIMEOUT_MS), and an unknown peer is an error rather than a dropped message.
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        self._router.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.LINGER, 0)
        for sock, where in ((self._pub, endpoints.endpoint), (self._router, endpoints.replay_endpoint)):
            try:
                sock.bind(where)
            except zmq.ZMQError as exc:
                self._close_sockets()
                raise ConfigError(
                    f"tiercache cannot listen for routers on {where} ({exc}); choose a free address for "
                    "kv_events_endpoint / kv_events_replay_endpoint in kv_connector_extra_config"
                ) from exc
        self.counts = {"batches": 0, "replays": 0, "snapshots": 0, "snapshot_blocks": 0, "abandoned": 0}
        self.last_snapshot_s = 0.0  # the latest snapshot's time, request to end marker sent
        self.last_lock_s = 0.0  # of which under the tracker's lock (the engine loop's wait)
        self._thread = threading.Thread(target=self._run, name="tiercache-kv-feed", daemon=True)
        self._thread.start()
        log.info(
            "tiercache: KV events for routers on %s, replay and snapshots on %s",
            endpoints.endpoint,
            endpoints.replay_endpoint,
        )

    def publish(self, events: list[Any]) -> None:
        """Queue one batch (engine loop, under the tracker's lock: the order of batches is the
        order of the changes the tracker read)."""
        self._queue.put(events)

    def close(self) -> None:
        """Send what is queued, stop the thread (bounded) and close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout=2.0)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        self._router.close(linger=0)
        self._ctx.term()

    # -- the feed thread -----------------------------------------------------------------------
    def _run(self) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self._batch = KVEventBatch
        self._encode = msgspec.msgpack.Encoder().encode
        while True:
            if self._router.poll(0):
                try:
                    self._serve()
                except zmq.ZMQError as exc:  # a router gone mid-reply: its loss, not the feed's
                    self.counts["abandoned"] += 1
                    log.warning("tiercache: a router's replay or snapshot was abandoned: %s", exc)
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                return
            self._send(events)

    def _send(self, events: list[Any]) -> None:
        payload = self._encode(self._batch(ts=time.time(), events=events, data_parallel_rank=self._rank))
        seq = self._next
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self._next = seq + 1
        self.counts["batches"] += 1

    def _drain(self) -> None:
        """Send every queued batch (under the tracker's lock: nothing more is queued meanwhile)."""
        while True:
            try:
                events = self._queue.get_nowait()
            except queue.Empty:
                return
            if events is None:
                self._queue.put(None)  # closing: let _run see it after this reply
                return
            self._send(events)

    def _serve(self) -> None:
        frames = self._router.recv_multipart()
        peer, body = frames[0], frames[-1]
        if body == SNAPSHOT_REQUEST:
            self._snapshot(peer)
        elif len(body) == 8:
            self._replay(peer, int.from_bytes(body, "big"))
        else:
            log.warning("tiercache: ignored a request on the KV events replay socket (%d bytes)", len(body))
            self._router.send_multipart((peer, b"", b"", END_SEQ, b""))

    def _replay(self, peer: bytes, start: int) -> None:
        self.counts["replays"] += 1
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._router.send_multipart((peer, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._router.send_multipart((peer, b"", b"", END_SEQ, b""))

    def _snapshot(self, peer: bytes) -> None:
        began = time.perf_counter()
        with self._lock:
            locked = time.perf_counter()
            self._drain()
            holdings = self._capture()
            upto = self._next.to_bytes(8, "big")
            self.last_lock_s = time.perf_counter() - locked
        blocks = 0
        for events in holdings.events(SNAPSHOT_BATCH):
            blocks += sum(len(e.block_hashes) for e in events)
            payload = self._encode(self._batch(ts=time.time(), events=events, data_parallel_rank=self._rank))
            self._router.send_multipart((peer, b"", self._topic, upto, payload))
        self._router.send_multipart((peer, b"", b"", END_SEQ, upto))
        self.last_snapshot_s = time.perf_counter() - began
        self.counts["snapshots"] += 1
        self.counts["snapshot_blocks"] = blocks
        log.info(
            "tiercache: sent a router a snapshot of %d blocks at seq %d in %.2f s",
            blocks,
            int.from_bytes(upto, "big"),
            self.last_snapshot_s,
        )


def open_feed(settings: ConnectorSettings, vllm_config: Any, tracker: KVEventTracker) -> HoldingsFeed | None:
    """The feed ``settings`` ask for (``kv_events_endpoint``), publishing ``tracker``'s events, its
    ports offset by the data-parallel rank as vLLM offsets its own publisher's; None when the
    events go into vLLM's stream."""
    if settings.kv_events_endpoint is None or settings.kv_events_replay_endpoint is None:
        return None
    from vllm.distributed.kv_events import ZmqEventPublisher

    rank = int(getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_rank", 0) or 0)
    endpoints = FeedEndpoints(
        endpoint=ZmqEventPublisher.offset_endpoint_port(settings.kv_events_endpoint, rank) or "",
        replay_endpoint=ZmqEventPublisher.offset_endpoint_port(settings.kv_events_replay_endpoint, rank)
        or "",
        topic=getattr(getattr(vllm_config, "kv_events_config", None), "topic", "") or "",
        buffer_batches=settings.kv_events_buffer_batches,
    )
    feed = HoldingsFeed(endpoints, tracker.holdings, tracker.lock, rank)
    tracker.publish_to(feed.publish)
    return feed


__all__ = ["END_SEQ", "SNAPSHOT_REQUEST", "FeedEndpoints", "Holdings", "HoldingsFeed", "open_feed"]
