"""Weights identity: what goes into ``LayoutManifest.model_revision`` so that replacing the weights
at the same model path never reuses KV computed with the old ones. No vLLM import here.

Order of preference:

1. an explicit ``weights_id`` setting;
2. the model revision vLLM was given (``--revision``);
3. for a local checkpoint directory (or a Hugging Face snapshot found in the local cache), a cheap
   *content fingerprint* of its weight files: for each ``*.safetensors`` / ``*.bin`` / ``*.pt`` /
   ``*.gguf`` file, its name, size, mtime and the xxh3 of its first and last MiB, plus the bytes of
   ``config.json``. Costs two 1-MiB reads per file.

Limits of (3), documented in docs/vllm.md: an in-place edit of a weight file that keeps its size and
touches neither the first nor the last MiB *and* restores the mtime is not noticed; copying the files
elsewhere (new mtime) changes the fingerprint, so a copy does not share the old KV (a miss, never a
wrong hit).
"""

from __future__ import annotations

import os
from pathlib import Path

import xxhash

_MiB = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def content_fingerprint(directory: Path) -> str | None:
    """``files:<32 hex>`` for the weight files in ``directory``, or ``None`` if it holds none."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    if not files:
        return None
    h = xxhash.xxh3_128()
    for path in files:
        st = path.stat()
        h.update(f"{path.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        with path.open("rb") as f:
            h.update(f.read(_MiB))
            if st.st_size > _MiB:
                f.seek(max(_MiB, st.st_size - _MiB))
                h.update(f.read(_MiB))
    config = directory / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    return f"files:{h.hexdigest()}"


def _hf_snapshot(model: str, revision: str | None) -> Path | None:
    """The local Hugging Face cache snapshot of ``model`` (no network), if there is one."""
    try:
        # Optional (vLLM brings it): absent where mypy runs, typed where it is installed.
        from huggingface_hub import snapshot_download  # type: ignore[import-not-found, unused-ignore]  # optional
    except ImportError:
        return None
    try:
        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not cached, or not a hub id: no identity from the cache
        return None


def weights_identity(model: str, revision: str | None = None, override: str | None = None) -> str:
    """The weights identity of ``model`` (a local path or a hub id); ``unknown`` if none is found."""
    if override:
        return f"id:{override}"
    path = Path(os.path.expanduser(model))
    if path.is_dir():
        found = content_fingerprint(path)
        if found is not None:
            return found
    if revision:
        return f"rev:{revision}"
    snapshot = _hf_snapshot(model, revision)
    if snapshot is not None:
        # The snapshot directory is named by the commit hash: that is the revision.
        return f"rev:{snapshot.name}"
    return "unknown"
