"""The boto3 side of the S3 tier: one client factory, and one translation of failed requests.

Both the tier (:mod:`tiercache.l3_s3.tier`) and the read-only inspector (:mod:`tiercache.l3_s3.reader`)
build their clients here, with the same timeouts, retries, pool and checksum settings, and turn
botocore's exceptions into one :class:`~tiercache.errors.S3TierError` that says what to check.
Credentials are never part of a message; an endpoint is shown without any user-info in its URL.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    NoCredentialsError,
    ParamValidationError,
    PartialCredentialsError,
)

from tiercache.config.parts import S3Config
from tiercache.errors import S3TierError

#: Error codes of a missing object (the service answered: not a failure of S3).
NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
#: ... and of a missing bucket.
NO_BUCKET_CODES = frozenset({"404", "NoSuchBucket", "NotFound"})
#: Error codes of refused credentials.
DENIED_CODES = frozenset({"403", "AccessDenied", "Forbidden"})
#: Error codes that mean "the service is overloaded or broken", not "your request is wrong".
THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "ServiceUnavailable",
        "InternalError",
        "RequestLimitExceeded",
        "TooManyRequests",
    }
)


def printable_endpoint(url: str | None) -> str:
    """The endpoint for messages and logs, without any ``user:password@`` someone put in the URL."""
    if not url:
        return "the AWS default endpoint"
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=netloc))


def where(config: S3Config) -> str:
    """``bucket 'b' at <endpoint>``: how messages name the bucket."""
    return f"bucket {config.bucket!r} at {printable_endpoint(config.endpoint_url)}"


def error_code(exc: ClientError) -> str:
    """The S3 error code of a refused request (``NoSuchKey``, ``403``, ``SlowDown``, ...)."""
    return str(exc.response.get("Error", {}).get("Code", "Unknown"))


def make_client(config: S3Config, *, for_heads: bool = False) -> Any:
    """A new boto3 S3 client with the tier's settings; the caller owns (and closes) it. ``for_heads``:
    the client of existence checks (one attempt, ``head_timeout_s``: a lookup waits on them).

    A fresh session per client: boto3's default session is module-level shared state.
    """
    botocfg = BotoConfig(
        connect_timeout=config.connect_timeout_s,
        read_timeout=config.head_timeout_s if for_heads else config.read_timeout_s,
        retries={"mode": "standard", "max_attempts": 1 if for_heads else config.max_attempts},
        max_pool_connections=config.max_concurrency,
        s3={"addressing_style": "path" if config.path_style else "auto"},
        # Frames carry their own xxh3 checksum; SDK checksums cost ~15% per put for nothing.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    try:
        return boto3.session.Session().client(
            "s3", endpoint_url=config.endpoint_url, region_name=config.region, config=botocfg
        )
    except (ValueError, BotoCoreError) as exc:
        raise S3TierError(
            # The exception text may echo the URL, user-info included: name its type only.
            f"cannot create an S3 client for {where(config)}: {type(exc).__name__}; check "
            "--s3-endpoint-url (http(s)://host[:port]) and --s3-region"
        ) from exc


def no_credentials(place: str) -> S3TierError:
    """The error for a missing or partial AWS credential chain (never names a credential)."""
    return S3TierError(
        f"no usable AWS credentials for S3 {place}; configure the standard chain "
        "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws/credentials, or an instance role)"
    )


def request_failure(exc: Exception, place: str, what: str, needs: str) -> S3TierError:
    """The one translation of a failed S3 request: ``what`` (``HeadBucket``, ``ListObjectsV2``, ...)
    against ``place`` (:func:`where`) failed with ``exc``; ``needs`` names the permissions the caller
    needs (``s3:ListBucket and s3:GetObject``). Returns the error to raise ``from exc``.
    """
    if isinstance(exc, ClientError):
        code = error_code(exc)
        if code in NOT_FOUND_CODES | NO_BUCKET_CODES:
            return S3TierError(f"S3 {place}: {what} found nothing ({code}); check --s3-bucket")
        if code in DENIED_CODES:
            return S3TierError(
                f"access to S3 {place} was denied ({what}); the credentials of the standard AWS chain "
                f"(environment, ~/.aws, instance role) need {needs} (see docs/s3.md)"
            )
        return S3TierError(
            f"S3 {place}: {what} failed: {code}; check --s3-bucket, --s3-region and the credentials' "
            "permissions (docs/s3.md)"
        )
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return no_credentials(place)
    if isinstance(exc, ParamValidationError):
        return S3TierError(f"S3 {place}: {what} was refused before it was sent: {exc}; fix --s3-bucket")
    return S3TierError(
        f"cannot reach S3 {place}: {type(exc).__name__}; check --s3-endpoint-url, --s3-region and the network"
    )
