"""Chunk hashing, fingerprints and layout manifests, and the ObjectKey encoding."""

from tiercache.keys.fingerprint import (
    FORMAT_VERSION,
    Fingerprint,
    GroupKind,
    LayoutManifest,
)
from tiercache.keys.hashing import HASH_BYTES, ExtraKeys, PrefixHasher, chunk_hashes, tail_hashes
from tiercache.keys.object_key import KEY_BYTES, ObjectKey

__all__ = [
    "FORMAT_VERSION",
    "HASH_BYTES",
    "KEY_BYTES",
    "ExtraKeys",
    "Fingerprint",
    "GroupKind",
    "LayoutManifest",
    "ObjectKey",
    "PrefixHasher",
    "chunk_hashes",
    "tail_hashes",
]
