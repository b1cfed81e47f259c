"""A strictly read-only view of an S3 tier's prefix, for ``tiercache inspect --s3-bucket``.

:class:`S3Reader` is not an :class:`~tiercache.l3_s3.S3Tier`: the tier's start-up listing enforces the
capacity bound (it may *delete* objects) and it can create buckets. The reader makes only three kinds
of request — ``HeadBucket``, ``ListObjectsV2`` and ``GetObject`` (manifests) — so it cannot change the
bucket whatever it is pointed at. Object names and the manifest layout are the tier's
(:mod:`tiercache.l3_s3.names`).

Where it runs and what it costs: every method may block on HTTP requests (the configured timeouts and
retries). :meth:`S3Reader.scan` lists the prefix once (one request per 1,000 objects) and caches the
result; :meth:`contains`, :meth:`iter_keys` and :meth:`usage` answer from that listing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Self, cast

from botocore.exceptions import BotoCoreError, ClientError

from tiercache.config.parts import S3Config
from tiercache.errors import S3TierError
from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey
from tiercache.l3_s3.client import (
    NOT_FOUND_CODES,
    error_code,
    make_client,
    request_failure,
    where,
)
from tiercache.l3_s3.names import ObjectNames
from tiercache.tier.contract import TierUsage

#: The only S3 operations this module issues (a test checks it).
READ_OPERATIONS = frozenset({"HeadBucket", "ListObjectsV2", "GetObject"})
#: What inspecting needs of the credentials.
_PERMISSIONS = "s3:ListBucket and s3:GetObject"


class S3Reader:
    """Read-only listing of the objects and manifests under ``config.prefix``.

    The constructor checks the bucket with one ``HeadBucket`` and raises
    :class:`~tiercache.errors.S3TierError` naming the bucket and endpoint (never credentials) and what
    to check. ``bytes_budget`` of :meth:`usage` is 0: the capacity is server configuration.
    """

    name = "s3"

    def __init__(self, config: S3Config) -> None:
        self.config = config
        self._names = ObjectNames(config.prefix)
        self._where = where(config)
        self._objects: dict[ObjectKey, int] | None = None
        self.client: Any = make_client(config)
        self._request("HeadBucket", lambda: self.client.head_bucket(Bucket=config.bucket))

    def _request(self, what: str, fn: Any) -> Any:
        """One request; failures become one :class:`S3TierError` saying what to check."""
        try:
            return fn()
        except (ClientError, BotoCoreError) as exc:
            raise request_failure(exc, self._where, what, _PERMISSIONS) from exc

    def _list(self, prefix: str) -> Iterator[tuple[str, int]]:
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.config.bucket, "Prefix": prefix}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._request("ListObjectsV2", lambda kw=kwargs: self.client.list_objects_v2(**kw))
            for obj in page.get("Contents", ()):
                yield obj["Key"], int(obj["Size"])
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    def scan(self) -> dict[ObjectKey, int]:
        """Every chunk object under the prefix with its size; listed once, then cached."""
        if self._objects is None:
            found: dict[ObjectKey, int] = {}
            for name, size in self._list(self._names.root):
                key = self._names.key_of(name)
                if key is not None:  # not a manifest or a foreign object under the prefix
                    found[key] = size
            self._objects = found
        return self._objects

    def usage(self) -> TierUsage:
        objects = self.scan()
        return TierUsage(sum(objects.values()), 0, len(objects))

    def iter_keys(self) -> Iterator[ObjectKey]:
        """Every chunk key under the prefix, in key order."""
        yield from sorted(self.scan(), key=ObjectKey.to_bytes)

    def contains(self, key: ObjectKey) -> bool:
        return key in self.scan()

    def get_manifest(self, fingerprint: Fingerprint) -> bytes | None:
        name = self._names.manifest(fingerprint)
        try:
            return cast(
                bytes,
                self._request(
                    "GetObject",
                    lambda: self.client.get_object(Bucket=self.config.bucket, Key=name)["Body"].read(),
                ),
            )
        except S3TierError as exc:
            if isinstance(exc.__cause__, ClientError) and error_code(exc.__cause__) in NOT_FOUND_CODES:
                return None
            raise

    def iter_manifests(self) -> Iterator[tuple[Fingerprint, bytes]]:
        """Every stored ``(fingerprint, manifest JSON)``: one LIST per 1,000 plus one GET each."""
        for name, _size in self._list(self._names.manifests):
            fp = self._names.fingerprint_of(name)
            if fp is None:
                continue
            data = self.get_manifest(fp)
            if data is not None:
                yield fp, data

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"S3Reader({self._where}, prefix={self.config.prefix!r})"


__all__ = ["READ_OPERATIONS", "S3Reader"]
