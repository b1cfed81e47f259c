"""The S3 tier's core (:class:`S3Core`): its state and locks, its boto3 clients (per process,
re-created after a fork), the bucket check at start-up, object names, and the one boundary every
request crosses (:meth:`S3Core._call`: the breaker, the concurrency bound, error translation).

:class:`~tiercache.l3_s3.bound.S3Bound` adds the capacity bound on top, and
:class:`~tiercache.l3_s3.tier.S3Tier` the tier contract: one object, one set of locks.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from botocore.exceptions import BotoCoreError, ClientError

from tiercache.config.parts import S3Config
from tiercache.errors import (
    CircuitOpenError,
    S3TierError,
)
from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey
from tiercache.l3_s3.breaker import BreakerState, CircuitBreaker
from tiercache.l3_s3.capacity import CapacityIndex
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
from tiercache.tier.contract import Tier
from tiercache.tier.staging import StagedWrites

log = logging.getLogger(__name__)

T = TypeVar("T")

#: What the tier's credentials need (docs/s3.md).
_PERMISSIONS = "s3:ListBucket, s3:GetObject, s3:PutObject and s3:DeleteObject"


class NotFound(Exception):
    """Internal to the S3 tier: the object does not exist (the service answered; not a failure)."""


@dataclass(slots=True)
class Lease:
    """Internal to the S3 tier: a pinned object and when its pin expires."""

    key: ObjectKey
    expires_at: float


class Closed(Exception):
    """Internal to the S3 tier: it closed while listing; a partial listing must not be reconciled."""


class S3Core(Tier):
    """The state, clients and request boundary of :class:`~tiercache.l3_s3.tier.S3Tier` (see there)."""

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
        self._leases: dict[int, Lease] = {}
        self._pins: dict[ObjectKey, int] = {}
        self._index = CapacityIndex()

        self._closed = threading.Event()
        self._indexed = threading.Event()
        self.check()
        self._open_heads_connection()

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

    def _open_heads_connection(self) -> None:
        """Build the existence checks' client and open its connection with one HEAD of the
        bucket, off the lookups' path: a client costs ~0.1 s of CPU on a quiet machine (several
        times that on a loaded one) and a connection a TCP (and TLS) handshake, which the first
        lookup would otherwise pay inside its --remote-lookup-budget-s. A failure here is left to
        the lookups, which count and report their own."""
        try:
            self.head_client.head_bucket(Bucket=self.config.bucket)
        except (ClientError, BotoCoreError) as exc:
            log.debug("S3 %s: the existence checks' first HEAD failed: %s", self._where, exc)

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

    def object_name(self, key: ObjectKey) -> str:
        """The S3 object name of ``key``: ``<prefix>/<key text>`` (no leading slash)."""
        return self._names.object(key)

    def manifest_name(self, fp: Fingerprint) -> str:
        """The S3 object name of the layout manifest of ``fp``."""
        return self._names.manifest(fp)

    def _call(self, what: str, fn: Callable[[Any], T], *, head: bool = False) -> T:
        """Run ``fn(client)`` through the breaker and the concurrency bound; translate failures.

        Raises :class:`NotFound` for a missing object (the service answered), :class:`CircuitOpenError`
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
                raise NotFound from exc
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

    def _head(self, key: ObjectKey) -> bool:
        """HEAD ``key`` (one request); remembers the answer. Raises S3TierError/CircuitOpenError."""
        name = self.object_name(key)
        try:
            self._call("HEAD", lambda c: c.head_object(Bucket=self.config.bucket, Key=name), head=True)
        except NotFound:
            self._exists.remember(key, False)
            return False
        self._exists.remember(key, True)
        return True

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
            except NotFound as exc:
                raise S3TierError(
                    f"S3 {self._where} disappeared while listing; was the bucket deleted? Recreate it or fix "
                    "--s3-bucket"
                ) from exc
            for obj in page.get("Contents", ()):
                yield obj["Key"], int(obj["Size"]), obj["LastModified"].timestamp()
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

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
