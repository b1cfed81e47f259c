"""Where each object lives in the bucket::

    s3://<bucket>/<prefix>/<fingerprint hex>/g<group>/<prefix hash hex>   one frame per chunk
    s3://<bucket>/<prefix>/manifests/<fingerprint hex>.json               layout manifests

Shared by the tier and the read-only inspector, so both read the same names.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey

#: Under the prefix: ``<fingerprint hex>.json`` per engine layout.
MANIFESTS = "manifests/"


@dataclass(frozen=True, slots=True)
class ObjectNames:
    """Object names under one deployment ``prefix`` (no leading or trailing slash)."""

    prefix: str

    @property
    def root(self) -> str:
        """What every name starts with: ``<prefix>/`` (empty without a prefix)."""
        return f"{self.prefix}/" if self.prefix else ""

    @property
    def manifests(self) -> str:
        """What every manifest name starts with."""
        return f"{self.root}{MANIFESTS}"

    def object(self, key: ObjectKey) -> str:
        """The S3 object name of ``key``: ``<prefix>/<key text>``."""
        return f"{self.root}{key.text()}"

    def manifest(self, fp: Fingerprint) -> str:
        """The S3 object name of the layout manifest of ``fp``."""
        return f"{self.manifests}{fp.hex}.json"

    def key_of(self, name: str) -> ObjectKey | None:
        """The key an object name stands for; ``None`` for a manifest or a foreign object."""
        root = self.root
        if not name.startswith(root):
            return None
        try:
            return ObjectKey.parse(name[len(root) :])
        except ValueError:  # KeyFormatError
            return None

    def fingerprint_of(self, name: str) -> Fingerprint | None:
        """The fingerprint a manifest object's name stands for, if it is one."""
        manifests = self.manifests
        if not name.startswith(manifests) or not name.endswith(".json"):
            return None
        try:
            return Fingerprint.from_hex(name[len(manifests) : -len(".json")])
        except ValueError:
            return None
