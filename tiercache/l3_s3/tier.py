"""The S3 tier (L3): cold chunks in S3 or any S3-compatible object store, shared by every node.

Layout (:mod:`tiercache.l3_s3.names`, ``docs/s3.md``)::

    s3://<bucket>/<prefix>/<fingerprint hex>/g<group>/<prefix hash hex>   one frame per chunk
    s3://<bucket>/<prefix>/manifests/<fingerprint hex>.json               layout manifests

Each object is one :func:`~tiercache.tier.frames.encode_frame` frame (header + payload, optionally zstd),
written with a single ``put_object`` and verified against the key asked for on every read. A frame that
fails verification is a counted miss and is deleted: never a wrong hit.

Where the calls run and what they cost: every method may block on HTTP requests bounded by the
configured connect/read timeouts and retry attempts; the engine calls this tier only from its own
bounded executors. Read-side methods (:meth:`S3Tier.pin`, :meth:`S3Tier.contains`,
:meth:`S3Tier.lookup_prefix`) never raise on S3 failures: an unhealthy S3 is a counted miss. A circuit
breaker stops requests entirely after repeated failures, so an outage costs a few timeouts and then
nothing until the cool-down ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import cast

from tiercache.config.parts import S3Config
from tiercache.errors import (
    FrameError,
    FrameVersionError,
    S3TierError,
    TierFullError,
)
from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey
from tiercache.keys.tenant import DEFAULT_TENANT
from tiercache.l3_s3.bound import S3Bound
from tiercache.l3_s3.core import Lease, NotFound
from tiercache.tier.contract import ReadHandle, TierUsage, WriteHandle
from tiercache.tier.frames import HEADER_BYTES, decode_frame, encode_frame
from tiercache.tier.stats import EvictionReason

log = logging.getLogger(__name__)


class S3Tier(S3Bound):
    """L3: chunks as self-verifying S3 objects under ``config.prefix``, bounded by ``capacity_bytes``.

    Construction checks that the bucket is reachable (creating it if ``config.create_bucket``) and
    raises :class:`~tiercache.errors.S3TierError` saying what to fix otherwise; it then starts a named
    daemon thread that lists the prefix to build the capacity index (objects written earlier, by this
    or another node). ``clock`` drives reservation/lease expiry, existence-cache TTLs and the breaker's
    cool-down; tests inject a fake one.

    Thread-safe. The boto3 client is per process and re-created after a fork.
    """

    def __init__(self, config: S3Config, *, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config, clock=clock)
        self._scanner = threading.Thread(
            target=self._scan_prefix, name=f"tiercache-s3-index[{config.bucket}]", daemon=True
        )
        self._scanner.start()

    # -- writes ---------------------------------------------------------------------------------------
    def reserve(self, key: ObjectKey, nbytes: int) -> WriteHandle:
        """Allocate a private buffer of ``nbytes`` for ``key``; no request is made.

        Raises :class:`TierFullError` when the framed object could never fit ``capacity_bytes``.
        Runs anywhere; costs one allocation of ``nbytes``.
        """
        self._check_fits(nbytes)
        self._expire(self._clock())
        return self._staged.reserve(key, nbytes)

    def commit(self, handle: WriteHandle) -> None:
        """Upload the reserved buffer as one framed object; blocks until S3 has it.

        Called from the engine's background write threads. Costs one PUT (plus DeleteObjects when the
        capacity bound needs room). Raises :class:`ReservationError` for an unknown, finished or
        expired reservation, :class:`CircuitOpenError` while the breaker is open and
        :class:`S3TierError` when the upload fails after retries.
        """
        self._upload(handle.key, memoryview(self._staged.take(handle)))

    def abort(self, handle: WriteHandle) -> None:
        """Drop a reservation (nothing was uploaded). Harmless if finished or expired."""
        self._staged.drop(handle)

    def put(
        self,
        key: ObjectKey,
        data: bytes | bytearray | memoryview,
        *,
        tenant: bytes = DEFAULT_TENANT,
        digest: int | None = None,
    ) -> None:
        """Frame ``data`` and upload it with one PUT, without the reservation's extra copy. The
        bucket keeps no tenant quotas (its capacity bound is shared): ``tenant`` is ignored.
        ``digest``: the frame is built from a private copy checked against it
        (:meth:`Tier.put <tiercache.tier.Tier.put>`), so nothing another process wrote is uploaded.

        Blocks until uploaded; same errors and costs as :meth:`commit`.
        """
        view = memoryview(data).cast("B")
        self._check_fits(view.nbytes)
        self._upload(key, view, digest)

    def _check_fits(self, nbytes: int) -> None:
        if nbytes + HEADER_BYTES > self.config.capacity_bytes:
            raise TierFullError(
                f"an object of {nbytes} bytes cannot fit the S3 capacity of "
                f"{self.config.capacity_bytes} bytes; raise --s3-capacity-gb"
            )

    def _upload(self, key: ObjectKey, payload: memoryview, digest: int | None = None) -> None:
        body = encode_frame(key, payload, compress=self.config.compress, digest=digest)
        name = self.object_name(key)
        self._call(
            "PUT",
            lambda c: c.put_object(Bucket=self.config.bucket, Key=name, Body=body),
        )
        self.stats.put(len(body), keys=(key,))
        with self._lock:
            self._index.set(key, len(body))
        self._exists.remember(key, True)
        self._enforce_capacity(keep=key)

    # -- reads ----------------------------------------------------------------------------------------
    def contains(self, key: ObjectKey) -> bool:
        """Whether ``key`` is believed present: the existence cache, else one HEAD request.

        Never raises: an S3 failure or an open breaker answers ``False`` (counted). Does not verify.
        """
        cached = self._exists.get(key)
        if cached is not None:
            return cached
        try:
            return self._head(key)
        except S3TierError:
            return False

    def pin(self, key: ObjectKey, *, count: bool = True) -> ReadHandle | None:
        """GET and verify ``key``; the payload is held in memory until :meth:`release`.

        Costs one GET of the whole object (none when the key is known to be missing). A frame that
        fails verification is deleted and counted (``verify_failures``, eviction ``corrupt``); any S3
        failure is a counted miss. Never raises on S3 failures, never returns wrong bytes.
        ``count=False``: neither a hit nor a miss, and no recency touch (see :meth:`Tier.pin`).
        """
        now = self._clock()
        self._expire(now)
        if self._exists.get(key) is False:
            self._miss(count)
            return None
        name = self.object_name(key)
        try:
            body = self._call(
                "GET",
                lambda c: c.get_object(Bucket=self.config.bucket, Key=name)["Body"].read(),
            )
        except NotFound:
            self._exists.remember(key, False)
            self._forget(key)
            self._miss(count)
            return None
        except S3TierError:
            self._miss(count)
            return None
        self.stats.add("bytes_read", len(body))
        try:
            payload = decode_frame(key, body)
        except FrameVersionError as exc:
            # Written by a build with another frame format (e.g. a newer node sharing the bucket
            # during a rolling upgrade): not ours to delete, not ours to read.
            log.warning("S3 object %s has an unreadable frame format: %s", name, exc)
            self.stats.add("verify_failures")
            self._miss(count)
            return None
        except FrameError as exc:
            log.warning("S3 object %s failed verification (%s); deleting it", name, exc)
            self.stats.add("verify_failures")
            self._miss(count)
            self._drop_corrupt(key)
            return None
        if count:
            self.stats.add("hits")
        self._exists.remember(key, True)
        token = next(self._tokens)
        expires_at = now + self.config.lease_ttl_s
        with self._lock:
            self._leases[token] = Lease(key, expires_at)
            self._pins[key] = self._pins.get(key, 0) + 1
            if count:
                self._index.touch(key)  # a read makes it young again (LRU-ish)
        return ReadHandle(key, memoryview(payload), token, expires_at)

    def _miss(self, count: bool) -> None:
        if count:
            self.stats.add("misses")

    def release(self, handle: ReadHandle) -> None:
        """End a pin; harmless twice or after expiry. No request."""
        with self._lock:
            lease = self._leases.pop(handle.token, None)
            if lease is not None:
                self._unpin(lease.key)

    def lookup_prefix(self, keys: Sequence[ObjectKey]) -> int:
        """How many leading ``keys`` are present, in O(log n) existence checks.

        Uses the prefix property (chunk i present ⇒ earlier chunks usually present): probe the first
        and last key, then binary-search the boundary with cache-aware HEADs — at most
        ``2 + ceil(log2 n)`` requests (11 for 512 keys), none for answers still in the existence
        cache. A hole *below* the boundary (an evicted middle chunk) is not seen here; it shows up as
        a miss when that chunk is pinned, and the engine then restores a shorter prefix. That is safe:
        a hole can only shorten what is loaded, never produce wrong bytes. Never raises.
        """
        n = len(keys)
        if n == 0 or not self.contains(keys[0]):
            return 0
        if self.contains(keys[n - 1]):
            return n
        lo, hi = 0, n - 1  # keys[lo] present, keys[hi] absent
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.contains(keys[mid]):
                lo = mid
            else:
                hi = mid
        return hi

    # -- management -----------------------------------------------------------------------------------
    def delete(self, key: ObjectKey) -> bool:
        """Delete ``key``; ``True`` if it was there. One DELETE, plus a HEAD for keys not indexed.

        A pinned payload stays readable (it is a private copy) until released. Raises
        :class:`S3TierError` / :class:`CircuitOpenError` if S3 cannot be reached.
        """
        with self._lock:
            known = key in self._index
        present = known or self._head(key)
        if not present:
            return False
        name = self.object_name(key)
        self._call("DELETE", lambda c: c.delete_object(Bucket=self.config.bucket, Key=name))
        self._forget(key)
        self._exists.remember(key, False)
        self.stats.evicted(EvictionReason.DELETED, keys=(key,))
        return True

    def usage(self) -> TierUsage:
        """Bytes (framed object sizes) and objects under the prefix, from the in-memory index.

        No request. Waits (at most ``read_timeout_s``) for the start-up listing so a fresh tier does
        not report an empty bucket; after that it is instant.
        """
        self._indexed.wait(self.config.read_timeout_s)
        with self._lock:
            return TierUsage(self._index.bytes_used, self.config.capacity_bytes, len(self._index))

    def wait_indexed(self, timeout: float | None = None) -> bool:
        """Block until the start-up listing has been merged into the index; ``True`` if it has."""
        return self._indexed.wait(timeout)

    def iter_keys(self) -> Iterator[ObjectKey]:
        """Every chunk object under the prefix, by listing the bucket (one request per 1000 keys).

        Names that are not object keys (manifests, foreign objects) are skipped. Raises
        :class:`S3TierError` if the listing fails.
        """
        for name, _size, _mtime in self._list():
            key = self._names.key_of(name)
            if key is not None:
                yield key

    def iter_keys_by_use(self) -> Iterator[ObjectKey]:
        """The capacity index newest first (listing mtimes, then this process's reads and writes);
        a bucket listing in name order while that index is still being built. No request once built."""
        if not self._indexed.is_set():
            return self.iter_keys()
        with self._lock:
            return iter(self._index.newest_first())

    def close(self) -> None:
        """Stop the index thread and close the client's connections. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._scanner.join(timeout=self.config.read_timeout_s + self.config.connect_timeout_s)
        with self._client_lock:
            clients, self._clients = self._clients, {}
        for client in clients.values():
            client.close()

    # -- manifests ------------------------------------------------------------------------------------
    def put_manifest(self, fingerprint: Fingerprint, data: bytes) -> None:
        """Store the layout manifest of ``fingerprint`` (canonical JSON); one PUT.

        Manifests are not counted against the capacity. Raises :class:`S3TierError` /
        :class:`CircuitOpenError` on failure.
        """
        name = self.manifest_name(fingerprint)
        self._call(
            "PUT manifest",
            lambda c: c.put_object(
                Bucket=self.config.bucket, Key=name, Body=data, ContentType="application/json"
            ),
        )

    def get_manifest(self, fingerprint: Fingerprint) -> bytes | None:
        """The stored manifest of ``fingerprint``, or ``None`` if absent or S3 is unreachable. One GET."""
        name = self.manifest_name(fingerprint)
        try:
            return cast(
                bytes,
                self._call(
                    "GET manifest",
                    lambda c: c.get_object(Bucket=self.config.bucket, Key=name)["Body"].read(),
                ),
            )
        except (NotFound, S3TierError):
            return None

    def iter_manifests(self) -> Iterator[tuple[Fingerprint, bytes]]:
        """Every stored ``(fingerprint, manifest JSON)``: one LIST per 1000 manifests plus one GET each.

        Meant for ``tiercache inspect``, not the request path. Raises :class:`S3TierError` if the
        listing fails; a manifest deleted meanwhile is skipped.
        """
        for name, _size, _mtime in self._list(self._names.manifests):
            fp = self._names.fingerprint_of(name)
            if fp is None:
                continue
            data = self.get_manifest(fp)
            if data is not None:
                yield fp, data
