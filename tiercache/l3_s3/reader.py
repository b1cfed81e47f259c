"""A strictly read-only view of an S3 tier's prefix, for ``tiercache inspect --s3-bucket``.

:class:`S3Reader` is not an :class:`~tiercache.l3_s3.S3Tier`: the tier's start-up listing enforces the
capacity bound (it may *delete* objects) and it can create buckets. The reader makes only three kinds
of request — ``HeadBucket``, ``ListObjectsV2`` and ``GetObject`` (manifests) — so it cannot change the
bucket whatever it is pointed at. Object names and the manifest layout are the tier's
(:meth:`S3Tier.object_name`, :meth:`S3Tier.manifest_name`).

Where it runs and what it costs: every method may block on HTTP requests (the configured timeouts and
retries). :meth:`S3Reader.scan` lists the prefix once (one request per 1,000 objects) and caches the
result; :meth:`contains`, :meth:`iter_keys` and :meth:`usage` answer from that listing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Self

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    NoCredentialsError,
    PartialCredentialsError,
)

from tiercache.config import S3Config
from tiercache.errors import S3TierError
from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey
from tiercache.l3_s3.tier import (
    MANIFESTS,
    _error_code,
    _printable_endpoint,
    manifest_fingerprint,
    no_credentials,
)
from tiercache.tier import TierUsage

#: The only S3 operations this module issues (a test checks it).
READ_OPERATIONS = frozenset({"HeadBucket", "ListObjectsV2", "GetObject"})


class S3Reader:
    """Read-only listing of the objects and manifests under ``config.prefix``.

    The constructor checks the bucket with one ``HeadBucket`` and raises
    :class:`~tiercache.errors.S3TierError` naming the bucket and endpoint (never credentials) and what
    to check. ``bytes_budget`` of :meth:`usage` is 0: the capacity is server configuration.
    """

    name = "s3"

    def __init__(self, config: S3Config) -> None:
        self.config = config
        self._objects: dict[ObjectKey, int] | None = None
        botocfg = BotoConfig(
            connect_timeout=config.connect_timeout_s,
            read_timeout=config.read_timeout_s,
            retries={"mode": "standard", "max_attempts": config.max_attempts},
            s3={"addressing_style": "path" if config.path_style else "auto"},
        )
        try:
            self.client: Any = boto3.session.Session().client(
                "s3", endpoint_url=config.endpoint_url, region_name=config.region, config=botocfg
            )
        except (ValueError, BotoCoreError) as exc:
            raise S3TierError(
                f"cannot create an S3 client for {self._where}: {type(exc).__name__}; check "
                "--s3-endpoint-url (http(s)://host[:port]) and --s3-region"
            ) from exc
        self._request("HeadBucket", lambda: self.client.head_bucket(Bucket=config.bucket))

    @property
    def _where(self) -> str:
        return f"bucket {self.config.bucket!r} at {_printable_endpoint(self.config.endpoint_url)}"

    @property
    def _prefix(self) -> str:
        return f"{self.config.prefix}/" if self.config.prefix else ""

    def _request(self, what: str, fn: Any) -> Any:
        """One request; failures become one :class:`S3TierError` saying what to check."""
        try:
            return fn()
        except ClientError as exc:
            code = _error_code(exc)
            if code in ("404", "NoSuchBucket", "NotFound", "NoSuchKey"):
                raise S3TierError(f"S3 {self._where}: {what} found nothing ({code}); check --s3-bucket") from exc
            if code in ("403", "AccessDenied", "Forbidden"):
                raise S3TierError(
                    f"access to S3 {self._where} was denied ({what}); inspecting needs s3:ListBucket and "
                    "s3:GetObject for the credentials of the standard AWS chain"
                ) from exc
            raise S3TierError(
                f"S3 {self._where}: {what} failed: {code}; check --s3-bucket, --s3-region and the credentials' "
                "permissions (docs/s3.md)"
            ) from exc
        except (NoCredentialsError, PartialCredentialsError) as exc:
            raise no_credentials(self._where) from exc
        except BotoCoreError as exc:
            raise S3TierError(
                f"cannot reach S3 {self._where}: {type(exc).__name__}; check --s3-endpoint-url, "
                "--s3-region and the network"
            ) from exc

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
            prefix = self._prefix
            for name, size in self._list(prefix):
                try:
                    found[ObjectKey.parse(name[len(prefix) :])] = size
                except ValueError:  # a manifest or a foreign object under the prefix
                    continue
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
        name = f"{self._prefix}{MANIFESTS}{fingerprint.hex}.json"
        try:
            return self._request(
                "GetObject", lambda: self.client.get_object(Bucket=self.config.bucket, Key=name)["Body"].read()
            )
        except S3TierError as exc:
            if isinstance(exc.__cause__, ClientError) and _error_code(exc.__cause__) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def iter_manifests(self) -> Iterator[tuple[Fingerprint, bytes]]:
        """Every stored ``(fingerprint, manifest JSON)``: one LIST per 1,000 plus one GET each."""
        prefix = f"{self._prefix}{MANIFESTS}"
        for name, _size in self._list(prefix):
            fp = manifest_fingerprint(name[len(prefix) :])
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
