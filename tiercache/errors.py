"""Every exception tiercache raises on purpose.

The tree::

    TierCacheError                      root: catch this to catch anything of ours
    ├── ConfigError                     a setting is invalid; the message names it and the fix
    │   └── SettingError                one field of a config holds a bad value (``.field``)
    ├── KeyFormatError                  bytes or text that are not a valid ObjectKey / fingerprint
    ├── FrameError                      an object frame failed verification (never surfaces as a hit)
    │   └── FrameVersionError           written by an unknown format version
    ├── IntegrityError                  bytes copied out of the shared arena differ from their digest
    ├── TierError                       a tier operation failed
    │   ├── TierFullError               no room even after evicting (all pinned/owed, or too large)
    │   ├── ReservationError            commit/abort of an unknown, expired or already finished reservation
    │   ├── LeaseError                  release of an unknown or expired read lease
    │   ├── ArenaError                  the shared L1 arena could not be created or attached
    │   ├── DiskTierError               LMDB failed (translated from lmdb.Error)
    │   └── S3TierError                 S3 failed after retries (translated from botocore errors)
    │       └── CircuitOpenError        S3 is considered unhealthy; the call was not attempted
    ├── CopyBackendError                the copy back-end cannot run here (e.g. CUDA without a GPU)
    ├── ServerError                     the server answered a request with an error (``.code`` says which)
    │   ├── ProtocolError               malformed / unknown / out-of-version message (either side)
    │   └── AuthenticationError         the server requires a shared secret or CURVE key we lack
    └── ServerUnavailableError          no server answered within the timeout (not running, wrong path)
        └── ServerNotListeningError     nothing listens at a ``unix://`` endpoint: said at once

Back-end exceptions are translated at the tier boundary with ``raise ... from exc`` so callers
never need to import lmdb or botocore to handle failures.
"""

from __future__ import annotations


class TierCacheError(Exception):
    """Root of every exception raised by tiercache."""


class ConfigError(TierCacheError):
    """A configuration value is invalid. The message names the setting and how to fix it."""


class SettingError(ConfigError):
    """Field ``field`` of a config object holds a bad value.

    The message is ``f"{label} {detail}"``: ``label`` names the setting (its flag, by default) and
    ``detail`` says what is wrong and the fix. A loader that knows where the value came from (an
    environment variable, a file key) re-raises it with :meth:`relabel`, so the user is pointed at
    the place to fix, not at a flag they never used.
    """

    def __init__(self, field: str, label: str, detail: str) -> None:
        super().__init__(f"{label} {detail}")
        self.field = field
        self.label = label
        self.detail = detail

    def relabel(self, label: str) -> SettingError:
        """The same error naming the setting ``label`` instead."""
        return SettingError(self.field, label, self.detail)


class KeyFormatError(TierCacheError, ValueError):
    """Bytes or text that do not parse as an ObjectKey or fingerprint."""


class FrameError(TierCacheError):
    """A stored object failed verification: wrong magic, key, length or checksum."""


class FrameVersionError(FrameError):
    """A stored object was written by a format version this build cannot read."""


class IntegrityError(TierCacheError):
    """Bytes copied out of the shared L1 arena differ from the digest their writer committed with
    them: another process wrote into the slot (late, outside its own slots, or torn). Never served;
    ``path`` names where it was caught (``l1_read``, ``write_through``, ``s3_upload``, ...)."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


class TierError(TierCacheError):
    """A tier operation failed."""


class TierFullError(TierError):
    """No room for the object even after evicting everything evictable."""


class ReservationError(TierError):
    """Commit or abort of a reservation that is unknown, expired or already finished.

    Raised by a batch commit, ``committed`` says how many of the batch before this reservation
    were committed (0 otherwise)."""

    committed: int = 0


class LeaseError(TierError):
    """Release of a read lease that is unknown or has expired."""


class ArenaError(TierError):
    """The shared-memory arena could not be created or attached."""


class DiskTierError(TierError):
    """The LMDB environment failed; the message says which path and what to check."""


class S3TierError(TierError):
    """An S3 request failed after its retries."""


class CircuitOpenError(S3TierError):
    """S3 has failed repeatedly; requests are skipped until the cool-down ends."""


class CopyBackendError(TierCacheError):
    """The requested copy back-end cannot run on this host."""


class ServerError(TierCacheError):
    """The server refused a request. ``code`` is the protocol's error code (``tier_full``, ...)."""

    def __init__(self, message: str, code: str = "internal") -> None:
        super().__init__(message)
        self.code = code


class ProtocolError(ServerError):
    """A message did not follow the protocol: malformed, unknown op, or another protocol version."""


class AuthenticationError(ServerError):
    """The server requires authentication (shared secret or CURVE) that this client did not give."""


class ServerUnavailableError(TierCacheError):
    """No tiercache server answered in time; check that it runs and that the endpoint matches."""


class ServerNotListeningError(ServerUnavailableError):
    """Nothing listens at the ``unix://`` endpoint (no socket there, or one nobody accepts on): the
    server is not running there now. Said at once, where ZeroMQ would wait for it."""
