"""Fingerprints: a 16-byte hash of everything that determines what stored KV bytes mean.

Two engines whose pages are not byte-compatible must get different fingerprints, so they can never
read each other's chunks. The :class:`LayoutManifest` lists those facts explicitly; its canonical
encoding (sorted-key JSON) is hashed with xxh3-128. The manifest is stored beside the data so that
``tiercache inspect`` can show what a fingerprint means and why two engines do not share.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
import xxhash

from tiercache.errors import KeyFormatError

#: Bumped whenever the meaning of stored bytes or of the manifest changes.
FORMAT_VERSION = 1
FINGERPRINT_BYTES = 16


class GroupKind(enum.StrEnum):
    """The kind of cached state an object group holds; decides the restorable-prefix rule."""

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    RECURRENT = "recurrent"


@dataclass(frozen=True, slots=True)
class LayoutManifest:
    """Every fact that decides whether two engines' pages for one object group are interchangeable.

    ``model_revision`` must change when the *weights* change (a revision, or a content fingerprint of
    the checkpoint files), not only when the name does. ``extra`` carries anything engine specific that
    has no field yet (e.g. the CPU kernel's ISA packing) as sorted ``(name, value)`` pairs.
    """

    model_id: str
    model_revision: str
    kv_dtype: str
    attention_backend: str
    kv_layout: str
    kernel_block_size: int
    manager_block_size: int
    page_bytes: int
    page_bytes_unpadded: int
    group_kind: GroupKind
    chunk_size: int
    num_layers: int
    kv_quantization: str = "none"
    sliding_window: int | None = None
    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_dtypes: tuple[str, ...] = ()
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    dcp_size: int = 1
    dcp_rank: int = 0
    extra: tuple[tuple[str, str], ...] = ()
    format_version: int = FORMAT_VERSION

    def canonical(self) -> bytes:
        """The canonical byte encoding hashed into the fingerprint (sorted-key JSON)."""
        return msgspec.json.encode(self.to_dict(), order="sorted")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict of the manifest (tuples become lists)."""
        d = asdict(self)
        d["group_kind"] = self.group_kind.value
        d["extra"] = dict(sorted(self.extra))
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayoutManifest:
        """Parse what :meth:`to_dict` produced (used when reading manifests back from storage)."""
        try:
            d = dict(data)
            d["group_kind"] = GroupKind(d["group_kind"])
            d["state_shapes"] = tuple(tuple(s) for s in d.get("state_shapes", ()))
            d["state_dtypes"] = tuple(d.get("state_dtypes", ()))
            d["extra"] = tuple(sorted(dict(d.get("extra", {})).items()))
            return cls(**d)
        except (KeyError, TypeError, ValueError) as exc:
            raise KeyFormatError(f"not a layout manifest: {exc}") from exc

    def fingerprint(self) -> Fingerprint:
        """Hash of :meth:`canonical`."""
        return Fingerprint(xxhash.xxh3_128_digest(self.canonical()))


@dataclass(frozen=True, slots=True, order=True)
class Fingerprint:
    """16 bytes identifying one byte-compatible page layout (see :class:`LayoutManifest`)."""

    raw: bytes = field()

    def __post_init__(self) -> None:
        if len(self.raw) != FINGERPRINT_BYTES:
            raise KeyFormatError(f"a fingerprint is {FINGERPRINT_BYTES} bytes, got {len(self.raw)}")

    @property
    def hex(self) -> str:
        """32 lowercase hex digits."""
        return self.raw.hex()

    @classmethod
    def from_hex(cls, text: str) -> Fingerprint:
        """Parse 32 hex digits."""
        try:
            return cls(bytes.fromhex(text))
        except ValueError as exc:
            raise KeyFormatError(f"{text!r} is not a 32-digit hex fingerprint") from exc

    def __str__(self) -> str:
        return self.hex
