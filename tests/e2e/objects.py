"""What a server stores for an e2e run, seen by object kind and by (prompt, chunk)."""

from __future__ import annotations

from tests.server.serverproc import ServerProcess
from tiercache.keys import ExtraKeys, GroupKind, LayoutManifest, ObjectKey, PrefixHasher


def stored_manifests(server: ServerProcess) -> dict[ObjectKey, LayoutManifest]:
    """Every object in the server's L1 and the manifest its engine registered for its group."""
    out: dict[ObjectKey, LayoutManifest] = {}
    with server.client() as c:
        keys, _ = c.list_keys(tier="l1")
        manifests: dict[bytes, LayoutManifest] = {}
        for listed in keys:
            key = ObjectKey.from_bytes(listed.key)
            if key.fingerprint.raw not in manifests:  # one round trip per group, not per object
                manifest = c.manifest(key.fingerprint)
                assert manifest is not None
                manifests[key.fingerprint.raw] = manifest
            out[key] = manifests[key.fingerprint.raw]
    return out


def stored_objects(server: ServerProcess) -> dict[ObjectKey, GroupKind]:
    """Every object in the server's L1 and the kind of its group (from the manifest the engine
    registered)."""
    return {key: manifest.group_kind for key, manifest in stored_manifests(server).items()}


def chunk_index(prompt_ids: list[list[int]], chunk_size: int) -> dict[bytes, tuple[int, int]]:
    """prefix hash → (prompt, chunk) for the full chunks of ``prompt_ids`` (no salt, no LoRA)."""
    index = {}
    for p, ids in enumerate(prompt_ids):
        for c, h in enumerate(PrefixHasher(chunk_size, ExtraKeys()).update(ids)):
            index[h] = (p, c)
    return index
