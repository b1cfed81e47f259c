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

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from botocore.exceptions import BotoCoreError, ClientError

from tiercache.config.parts import S3Config
from tiercache.errors import (
    CircuitOpenError,
    FrameError,
    FrameVersionError,
    S3TierError,
    TierFullError,
)
from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey
from tiercache.keys.tenant import DEFAULT_TENANT
from tiercache.l3_s3.breaker import BreakerState, CircuitBreaker
from tiercache.l3_s3.capacity import CapacityIndex, Listing, rebuild
from tiercache.l3_s3.client import (
    NO_BUCKET_CODES,
    NOT_FOUND_CODES,
    THROTTLE_CODES,
    error_code,
    make_client,
    request_failure,
    where,
)
from tiercache.l3_s3.index import ExistenceCache
from tiercache.l3_s3.names import ObjectNames
from tiercache.tier.contract import ReadHandle, Tier, TierUsage, WriteHandle
from tiercache.tier.frames import HEADER_BYTES, decode_frame, encode_frame
from tiercache.tier.staging import StagedWrites
from tiercache.tier.stats import EvictionReason

log = logging.getLogger(__name__)

T = TypeVar("T")

#: DeleteObjects accepts at most this many keys per request.
DELETE_BATCH = 1000
#: How often the index thread checks whether this process's writes and reads need merging, seconds.
MERGE_CHECK_S = 1.0
#: What the tier's credentials need (docs/s3.md).
_PERMISSIONS = "s3:ListBucket, s3:GetObject, s3:PutObject and s3:DeleteObject"


class _NotFound(Exception):
    """Internal: the object does not exist (the service answered; not a failure)."""


@dataclass(slots=True)
class _Lease:
    key: ObjectKey
    expires_at: float


class _Closed(Exception):
    """The tier closed while listing: a partial listing must not be reconciled."""


class S3Tier(Tier):
    """L3: chunks as self-verifying S3 objects under ``config.prefix``, bounded by ``capacity_bytes``.

    Construction checks that the bucket is reachable (creating it if ``config.create_bucket``) and
    raises :class:`~tiercache.errors.S3TierError` saying what to fix otherwise; it then starts a named
    daemon thread that lists the prefix to build the capacity index (objects written earlier, by this
    or another node). ``clock`` drives reservation/lease expiry, existence-cache TTLs and the breaker's
    cool-down; tests inject a fake one.

    Thread-safe. The boto3 client is per process and re-created after a fork.
    """

    name = "s3"
    remote = True  # every existence check is a round trip: the engine asks lookup_prefix for runs

    def __init__(self, config: S3Config, *, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.config = config
        self._clock = clock
        self._breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s, clock=clock)
        # Bounds in-flight requests from all threads to the connection pool's size, so callers queue
        # here instead of opening and discarding extra connections.
        self._slots = threading.BoundedSemaphore(config.max_concurrency)
        self._client_lock = threading.Lock()
        self._clients: dict[bool, Any] = {}  # guarded by _client_lock; True: the HEADs' client
        self._client_pid = -1  # guarded by _client_lock
        self._tokens = itertools.count(1)

        self._names = ObjectNames(config.prefix)
        self._where = where(config)
        self._staged = StagedWrites(config.reservation_ttl_s, clock, self.stats)
        self._exists = ExistenceCache(config.exists_ttl_s, config.missing_ttl_s, clock)
        self._lock = threading.Lock()
        # guarded by _lock:
        self._leases: dict[int, _Lease] = {}
        self._pins: dict[ObjectKey, int] = {}
        self._index = CapacityIndex()

        self._closed = threading.Event()
        self._indexed = threading.Event()
        self.check()
        self._scanner = threading.Thread(
            target=self._scan_prefix, name=f"tiercache-s3-index[{config.bucket}]", daemon=True
        )
        self._scanner.start()

    # -- client and start-up --------------------------------------------------------------------
    @property
    def client(self) -> Any:
        """This process's boto3 S3 client (re-created after a fork).

        Public for instrumentation, e.g. counting requests with ``client.meta.events.register``.
        """
        return self._own_client(heads=False)

    @property
    def head_client(self) -> Any:
        """This process's client for existence checks: one attempt, ``head_timeout_s`` (a lookup
        waits on them; :meth:`contains`)."""
        return self._own_client(heads=True)

    def _own_client(self, *, heads: bool) -> Any:
        pid = os.getpid()
        with self._client_lock:
            if self._client_pid != pid:
                # A client (and its connection pool) must not cross a fork: sockets would be shared.
                self._clients = {}
                self._client_pid = pid
            client = self._clients.get(heads)
            if client is None:
                client = self._clients[heads] = make_client(self.config, for_heads=heads)
            return client

    def raw_client(self) -> Any:
        """A new, independent boto3 S3 client with exactly this tier's settings; the caller owns it.

        For baselines (``tiercache bench`` compares the tier with raw ``put_object``/``get_object``
        through the same timeouts, retries, pool size and checksum settings). Call ``.close()`` on it.
        """
        return make_client(self.config)

    def check(self) -> None:
        """Verify the bucket is reachable (HEAD bucket), creating it if ``config.create_bucket``.

        Called by the constructor; costs one or two requests. Raises :class:`S3TierError` naming the
        bucket, the endpoint and what to check. Credentials are never part of the message.
        """
        client = self.client  # raises S3TierError for an unusable endpoint URL
        try:
            client.head_bucket(Bucket=self.config.bucket)
            return
        except ClientError as exc:
            if error_code(exc) not in NO_BUCKET_CODES:
                raise request_failure(exc, self._where, "HeadBucket", _PERMISSIONS) from exc
            if not self.config.create_bucket:
                raise S3TierError(
                    f"S3 {self._where} does not exist; create it, fix --s3-bucket, or enable create_bucket"
                ) from exc
        except BotoCoreError as exc:
            raise request_failure(exc, self._where, "HeadBucket", _PERMISSIONS) from exc
        self._create_bucket()

    def _create_bucket(self) -> None:
        kwargs: dict[str, Any] = {"Bucket": self.config.bucket}
        region = self.config.region or self.client.meta.region_name
        if region and region != "us-east-1":
            # us-east-1 is the only region that rejects an explicit location constraint.
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            self.client.create_bucket(**kwargs)
        except ClientError as exc:
            if error_code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise S3TierError(
                    f"could not create S3 {self._where}: {error_code(exc)}; create it yourself or "
                    "grant s3:CreateBucket"
                ) from exc
        except BotoCoreError as exc:
            raise S3TierError(
                f"could not create S3 {self._where}: {type(exc).__name__}; check --s3-endpoint-url and the network, "
                "or create the bucket yourself"
            ) from exc
        log.info("created S3 %s", self._where)

    # -- names ----------------------------------------------------------------------------------
    def object_name(self, key: ObjectKey) -> str:
        """The S3 object name of ``key``: ``<prefix>/<key text>`` (no leading slash)."""
        return self._names.object(key)

    def manifest_name(self, fp: Fingerprint) -> str:
        """The S3 object name of the layout manifest of ``fp``."""
        return self._names.manifest(fp)

    # -- the one request boundary ---------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[Any], T], *, head: bool = False) -> T:
        """Run ``fn(client)`` through the breaker and the concurrency bound; translate failures.

        Raises :class:`_NotFound` for a missing object (the service answered), :class:`CircuitOpenError`
        without trying while the breaker is open, and :class:`S3TierError` for anything else after
        botocore's own retries (counted in ``stats.errors``).
        """
        if self._closed.is_set():
            # A writer left behind by a shutdown must not land objects (or open a new client) later.
            raise S3TierError(
                f"S3 {what} on {self._where} refused: this S3 tier is closed; create a new S3Tier to use it"
            )
        if not self._breaker.allow():
            self.stats.add("skipped")
            raise CircuitOpenError(
                f"S3 {self._where} failed {self.config.breaker_failures} times in a row; "
                f"{what} skipped for up to {self.config.breaker_cooldown_s:g} s"
            )
        try:
            client = self.head_client if head else self.client
            with self._slots:
                result = fn(client)
        except S3TierError:  # the client itself could not be built (after a fork, say)
            self._breaker.record_failure()
            self.stats.add("errors")
            raise
        except ClientError as exc:
            code = error_code(exc)
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in NOT_FOUND_CODES:
                self._breaker.record_success()
                raise _NotFound from exc
            if status >= 500 or code in THROTTLE_CODES:
                self._breaker.record_failure()
            else:
                self._breaker.record_success()  # it answered; the request itself was refused
            self.stats.add("errors")
            raise S3TierError(f"S3 {what} on {self._where} failed: {code} (HTTP {status})") from exc
        except (BotoCoreError, OSError) as exc:
            # Connection refused/reset, timeouts, truncated bodies: the endpoint is unhealthy.
            self._breaker.record_failure()
            self.stats.add("errors")
            raise S3TierError(f"S3 {what} on {self._where} failed: {type(exc).__name__}") from exc
        except BaseException:
            self._breaker.record_failure()  # never leave a half-open trial unreported
            raise
        self._breaker.record_success()
        return result

    @property
    def breaker_state(self) -> BreakerState:
        """Whether S3 is currently considered healthy (``closed``) or skipped (``open``)."""
        return self._breaker.state

    # -- existence -------------------------------------------------------------------------------
    def _head(self, key: ObjectKey) -> bool:
        """HEAD ``key`` (one request); remembers the answer. Raises S3TierError/CircuitOpenError."""
        name = self.object_name(key)
        try:
            self._call("HEAD", lambda c: c.head_object(Bucket=self.config.bucket, Key=name), head=True)
        except _NotFound:
            self._exists.remember(key, False)
            return False
        self._exists.remember(key, True)
        return True

    # -- writes ---------------------------------------------------------------------------------
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

    # -- reads ----------------------------------------------------------------------------------
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
        except _NotFound:
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
            self._leases[token] = _Lease(key, expires_at)
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

    # -- management -----------------------------------------------------------------------------
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

    # -- manifests ------------------------------------------------------------------------------
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
        except (_NotFound, S3TierError):
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

    # -- capacity index -------------------------------------------------------------------------
    def _list(self, prefix: str | None = None) -> Iterator[tuple[str, int, float]]:
        """``(name, size, last-modified epoch)`` of every object under ``prefix``, page by page."""
        prefix = self._names.root if prefix is None else prefix
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.config.bucket, "Prefix": prefix}
            if token:
                kwargs["ContinuationToken"] = token

            def list_page(c: Any, kw: dict[str, Any] = kwargs) -> Any:
                return c.list_objects_v2(**kw)

            try:
                page = self._call("LIST", list_page)
            except _NotFound as exc:
                raise S3TierError(
                    f"S3 {self._where} disappeared while listing; was the bucket deleted? Recreate it or fix "
                    "--s3-bucket"
                ) from exc
            for obj in page.get("Contents", ()):
                yield obj["Key"], int(obj["Size"]), obj["LastModified"].timestamp()
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    def _scan_prefix(self) -> None:
        """Background thread: list the prefix once and merge it into the index, oldest first; then
        relist every ``relist_interval_s`` and merge what this process wrote and read whenever it
        grows past the index's limit (:mod:`tiercache.l3_s3.capacity`)."""
        try:
            listed = Listing()
            try:
                listed = self._list_chunks()
            except _Closed:
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
        except _Closed:
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
        :class:`_Closed` if the tier closes meanwhile (a partial listing must not be merged)."""
        listed = Listing()
        try:
            for name, size, mtime in self._list():
                if self._closed.is_set():
                    raise _Closed
                key = self._names.key_of(name)
                if key is not None:
                    listed.add(key, mtime, size)
        except S3TierError:
            if self._closed.is_set():  # the next page was refused because the tier closed
                raise _Closed from None
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
        except (S3TierError, _NotFound) as exc:
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
        except (S3TierError, _NotFound):
            pass  # still a miss; the next read verifies (and tries to delete) again
        self._forget(key)
        self._exists.remember(key, False)
        self.stats.evicted(EvictionReason.CORRUPT, keys=(key,))

    # -- expiry ---------------------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        """Drop expired reservations and leases (a crashed caller cannot pin objects forever)."""
        self._staged.expire()
        with self._lock:
            dead_leases = [t for t, lease in self._leases.items() if lease.expires_at <= now]
            for token in dead_leases:
                self._unpin(self._leases.pop(token).key)
        if dead_leases:
            self.stats.add("expired_leases", len(dead_leases))

    def _unpin(self, key: ObjectKey) -> None:
        # caller holds _lock
        count = self._pins.get(key, 0) - 1
        if count > 0:
            self._pins[key] = count
        else:
            self._pins.pop(key, None)
