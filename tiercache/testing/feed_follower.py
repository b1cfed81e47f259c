"""A router's side of the connector's KV-event feed (:mod:`tiercache.connector.feed`): a snapshot,
then the live batches after it, each applied once and in order, folded into the set of blocks each
medium holds. The tests use it; a router author can read it as the recipe.

1. Subscribe to the feed (SUB) before anything else, so no batch published from then on is missed.
2. Ask for a snapshot (DEALER, ``b"snapshot"``): ``BlockStored`` batches, all numbered ``next``,
   then the end marker carrying ``next``. The fold is the snapshot.
3. Ask for a replay from ``next`` (8 bytes big-endian) and apply what it returns: the batches
   published while the subscription was still settling.
4. Apply live batches: a ``seq`` below ``next`` is one applied already (skip it); above it, a gap
   (replay from ``next``; a replay that no longer reaches back that far means a new snapshot).

Needs no vLLM: batches are decoded with structs of their own that keep only what a fold needs
(vLLM's ``KVEventBatch`` travels as an array ``[ts, events, rank]``, each event a map tagged with its
``type``; the fields not named here are skipped).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
import zmq

SNAPSHOT_REQUEST = b"snapshot"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


BlockHash = int | bytes  # vLLM's ExternalBlockHash


class Stored(msgspec.Struct, tag="BlockStored"):
    """The fields of vLLM's ``BlockStored`` a fold needs (the others are skipped undecoded)."""

    block_hashes: list[BlockHash]
    medium: str | None = None


class Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None


class Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class Batch(msgspec.Struct, array_like=True):
    """vLLM's ``KVEventBatch`` as it travels: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[Stored | Removed | Cleared]
    data_parallel_rank: int | None = None


@dataclass
class FeedFold:
    """What the feed said so far: medium → block hashes held, and how it got there."""

    held: dict[str, set[BlockHash]] = field(default_factory=dict)
    next_seq: int = 0  # the seq of the next batch to apply
    snapshots: int = 0
    replays: int = 0
    applied: list[int] = field(default_factory=list)  # seqs applied after a snapshot, in order
    skipped: int = 0  # live batches already applied (from a replay)

    def apply(self, events: list[Stored | Removed | Cleared]) -> None:
        """Fold one batch's events."""
        for event in events:
            if isinstance(event, Cleared):
                self.held.clear()
            elif isinstance(event, Stored):
                self.held.setdefault(str(event.medium), set()).update(event.block_hashes)
            else:
                self.held.setdefault(str(event.medium), set()).difference_update(event.block_hashes)

    def as_pairs(self) -> set[tuple[str, BlockHash]]:
        """Every ``(medium, block hash)`` held."""
        return {(m, h) for m, hashes in self.held.items() for h in hashes}


class FeedFollower:
    """Follows one replica's feed; :meth:`start` then :meth:`pump` as long as it runs."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str = "", timeout_s: float = 10.0) -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.connect(endpoint)
        self._replay = self._ctx.socket(zmq.DEALER)
        self._replay.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.connect(replay_endpoint)
        self._decode = msgspec.msgpack.Decoder(Batch).decode
        self.fold = FeedFold()

    def close(self) -> None:
        self._sub.close(linger=0)
        self._replay.close(linger=0)
        self._ctx.term()

    def start(self) -> float:
        """Snapshot, then replay from its ``next``: the seconds the snapshot took to arrive."""
        began = time.perf_counter()
        self._snapshot()
        took = time.perf_counter() - began
        self._catch_up()
        return took

    def resume(self, fold: FeedFold) -> None:
        """Go on from a fold saved earlier (a router restarting from its own saved state): replay
        from its ``next_seq``, or snapshot anew if the feed's buffer no longer reaches back."""
        self.fold = fold
        self._catch_up()

    def pump(self, duration_s: float) -> None:
        """Apply live batches for ``duration_s`` seconds."""
        deadline = time.monotonic() + duration_s
        while (left := deadline - time.monotonic()) > 0:
            if not self._sub.poll(int(left * 1000) + 1):
                continue
            _topic, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq < self.fold.next_seq:
                self.fold.skipped += 1
                continue
            if seq > self.fold.next_seq:  # a gap: what came between is in the replay buffer
                self._catch_up()
                if seq < self.fold.next_seq:
                    self.fold.skipped += 1
                    continue
            self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.fold.next_seq, (seq, self.fold.next_seq)
        self.fold.apply(self._decode(payload).events)
        self.fold.applied.append(seq)
        self.fold.next_seq = seq + 1

    def _snapshot(self) -> None:
        self._replay.send_multipart((b"", SNAPSHOT_REQUEST))
        fold = FeedFold(snapshots=self.fold.snapshots + 1, replays=self.fold.replays)
        while True:
            _, _topic, seq_bytes, payload = self._replay.recv_multipart()
            if seq_bytes == END_SEQ:
                fold.next_seq = int.from_bytes(payload, "big")
                self.fold = fold
                return
            fold.apply(self._decode(payload).events)

    def _catch_up(self) -> None:
        """Replay from ``next_seq``; if the buffer no longer reaches back, snapshot again."""
        self.fold.replays += 1
        self._replay.send_multipart((b"", self.fold.next_seq.to_bytes(8, "big")))
        replayed: list[tuple[int, bytes]] = []
        while True:
            _, _topic, seq_bytes, payload = self._replay.recv_multipart()
            if seq_bytes == END_SEQ:
                break
            replayed.append((int.from_bytes(seq_bytes, "big"), payload))
        if replayed and replayed[0][0] > self.fold.next_seq:
            self._snapshot()
            return self._catch_up()
        for seq, payload in replayed:
            if seq >= self.fold.next_seq:
                self._apply(seq, payload)
        return None


__all__ = ["Batch", "Cleared", "FeedFold", "FeedFollower", "Removed", "Stored"]
