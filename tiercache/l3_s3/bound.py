"""The S3 tier's capacity bound (:class:`S3Bound`): the index thread that lists the prefix at
start-up and every ``relist_interval_s``, merges listings and this process's writes and reads into
the capacity index (:mod:`tiercache.l3_s3.capacity`) outside the tier's lock, and evicts the oldest
objects beyond ``capacity_bytes`` with DeleteObjects.
"""

from __future__ import annotations

import logging
import time

from tiercache.errors import (
    S3TierError,
)
from tiercache.keys.object_key import ObjectKey
from tiercache.l3_s3.capacity import Listing, rebuild
from tiercache.l3_s3.core import Closed, NotFound, S3Core
from tiercache.tier.stats import EvictionReason

log = logging.getLogger(__name__)

#: DeleteObjects accepts at most this many keys per request.
DELETE_BATCH = 1000
#: How often the index thread checks whether this process's writes and reads need merging, seconds.
MERGE_CHECK_S = 1.0


class S3Bound(S3Core):
    """The capacity bound of :class:`~tiercache.l3_s3.tier.S3Tier`: its index thread and evictions."""

    def _scan_prefix(self) -> None:
        """Background thread: list the prefix once and merge it into the index, oldest first; then
        relist every ``relist_interval_s`` and merge what this process wrote and read whenever it
        grows past the index's limit (:mod:`tiercache.l3_s3.capacity`)."""
        try:
            listed = Listing()
            try:
                listed = self._list_chunks()
            except Closed:
                return
            except S3TierError as exc:
                log.warning(
                    "could not list S3 %s to build the capacity index (%s); only objects written "
                    "by this process count against the S3 capacity until the next start",
                    self._where,
                    exc,
                )
            self._merge(listed, drop_unlisted=False)
            if not self._closed.is_set():
                # Objects from earlier runs (or other nodes) may already exceed the capacity.
                self._enforce_capacity(keep=None)
        except Exception:  # a bug here must not leave usage() waiting on an index forever
            log.exception("building the S3 capacity index failed")
        finally:
            self._indexed.set()
        interval = self.config.relist_interval_s
        next_relist = time.monotonic() + interval if interval > 0 else float("inf")
        while not self._closed.wait(min(interval, MERGE_CHECK_S) if interval > 0 else MERGE_CHECK_S):
            try:
                if time.monotonic() >= next_relist:
                    self._relist()
                    next_relist = time.monotonic() + interval
                else:
                    self._merge_young()
            except Exception:  # keep the thread (and the bound) alive; the next pass retries
                log.exception("maintaining the S3 capacity index failed")

    def _relist(self) -> None:
        """List the prefix again and reconcile the index with it, so the capacity bound holds for
        the prefix as a whole: other nodes' writes count (and are evicted, oldest first) and their
        deletions are forgotten. A failed listing keeps the index as it is."""
        with self._lock:
            self._index.begin_rebuild()
        try:
            listed = self._list_chunks()
        except Closed:
            return
        except Exception as exc:  # S3 down, or a bug: keep the index as it is, retry next interval
            log.warning(
                "could not list S3 %s to count other nodes' objects (%s); retrying later", self._where, exc
            )
            with self._lock:
                self._index.abandon_rebuild()
            return
        added, dropped = self._merge(listed, drop_unlisted=True)
        log.debug(
            "relisted S3 %s: %d objects, %d new from other writers, %d deleted by them; %d bytes",
            self._where,
            len(listed),
            added,
            dropped,
            self._index.bytes_used,
        )
        self._enforce_capacity(keep=None)

    def _merge_young(self) -> None:
        """Merge what this process wrote and read into the index's columns once it outgrew its limit."""
        with self._lock:
            if not self._index.wants_merge():
                return
            self._index.begin_rebuild()
        self._merge(None, drop_unlisted=False)

    def _merge(self, listed: Listing | None, *, drop_unlisted: bool) -> tuple[int, int]:
        """Merge (the O(n log n) part outside the lock); ``(added, dropped)`` by the listing."""
        with self._lock:
            frozen = self._index.freeze()
        rebuilt = rebuild(frozen, listed, drop_unlisted=drop_unlisted)
        with self._lock:
            self._index.install(rebuilt)
        return rebuilt.added, rebuilt.dropped

    def _list_chunks(self) -> Listing:
        """Every chunk object under the prefix, packed (no object per entry); raises
        :class:`Closed` if the tier closes meanwhile (a partial listing must not be merged)."""
        listed = Listing()
        try:
            for name, size, mtime in self._list():
                if self._closed.is_set():
                    raise Closed
                key = self._names.key_of(name)
                if key is not None:
                    listed.add(key, mtime, size)
        except S3TierError:
            if self._closed.is_set():  # the next page was refused because the tier closed
                raise Closed from None
            raise
        return listed

    def _forget(self, key: ObjectKey) -> None:
        with self._lock:
            self._index.forget(key)

    def _enforce_capacity(self, keep: ObjectKey | None) -> None:
        """Delete the oldest objects until the index fits ``capacity_bytes``.

        Victims are chosen and removed from the index under the lock (so concurrent callers never
        pick the same one), then deleted outside it with DeleteObjects in batches of 1000. Pinned
        and just-written objects are skipped.
        """
        self._expire(self._clock())
        with self._lock:
            excess = self._index.bytes_used - self.config.capacity_bytes
            if excess <= 0:
                return
            pins = self._pins
            victims = self._index.take_oldest(excess, lambda key: key == keep or bool(pins.get(key)))
        for start in range(0, len(victims), DELETE_BATCH):
            batch = victims[start : start + DELETE_BATCH]
            self._delete_batch(batch)

    def _delete_batch(self, batch: list[tuple[ObjectKey, int]]) -> None:
        objects = [{"Key": self.object_name(key)} for key, _ in batch]
        try:
            reply = self._call(
                "DeleteObjects",
                lambda c: c.delete_objects(
                    Bucket=self.config.bucket, Delete={"Objects": objects, "Quiet": True}
                ),
            )
            failed = {e.get("Key") for e in reply.get("Errors", ())}
        except (S3TierError, NotFound) as exc:
            log.warning("S3 capacity eviction of %d objects failed: %s", len(batch), exc)
            failed = {o["Key"] for o in objects}
        gone: list[ObjectKey] = []
        with self._lock:
            for key, size in batch:
                if self.object_name(key) in failed:
                    self._index.restore_oldest(key, size)  # the next eviction retries it
                else:
                    gone.append(key)
                    self._exists.remember(key, False)
        if gone:
            self.stats.evicted(EvictionReason.CAPACITY, len(gone), keys=gone)

    def _drop_corrupt(self, key: ObjectKey) -> None:
        name = self.object_name(key)
        try:
            self._call("DELETE corrupt", lambda c: c.delete_object(Bucket=self.config.bucket, Key=name))
        except (S3TierError, NotFound):
            pass  # still a miss; the next read verifies (and tries to delete) again
        self._forget(key)
        self._exists.remember(key, False)
        self.stats.evicted(EvictionReason.CORRUPT, keys=(key,))
