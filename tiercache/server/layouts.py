"""The engine layouts clients registered: each object group's fingerprint and lookup rule.

Registration checks a layout against the server's settings (chunk size, object groups) before its
manifests are stored; lookups and ``explain`` then resolve ``(fingerprint, group)`` references to the
:class:`~tiercache.engine.GroupSpec` the engine's rule needs, reading a manifest back from L2/L3
when another process registered it (a restarted server, another node sharing the bucket).
"""

from __future__ import annotations

import threading

import msgspec

from tiercache.config.parts import ServerOptions
from tiercache.engine import GroupSpec, TieredEngine
from tiercache.keys.fingerprint import Fingerprint, GroupKind, LayoutManifest
from tiercache.keys.hashing import HASH_BYTES
from tiercache.server.replies import Refused
from tiercache.wire import protocol as p


class Layouts:
    """Registered group specs by ``(fingerprint, object group)``. Thread-safe: the request loop
    checks and records, the I/O executor resolves."""

    def __init__(self, engine: TieredEngine, options: ServerOptions) -> None:
        self._engine = engine
        self._options = options
        self._lock = threading.Lock()
        self._specs: dict[tuple[bytes, int], GroupSpec] = {}  # guarded by _lock

    def check(self, msg: p.RegisterEngine) -> list[tuple[int, LayoutManifest]]:
        """The ``(group, manifest)`` pairs of a registration, or :class:`Refused` saying what does
        not fit this server. Request loop; no I/O."""
        opts = self._options
        if not msg.groups:
            raise Refused(p.ErrorCode.INVALID, "register needs at least one object group")
        if not opts.separate_object_groups and len(msg.groups) > 1:
            raise Refused(
                p.ErrorCode.INVALID,
                f"this server runs with --no-separate-object-groups: register one object group "
                f"holding every layer, not {len(msg.groups)}",
            )
        seen: set[int] = set()
        parsed: list[tuple[int, LayoutManifest]] = []
        for g in msg.groups:
            if g.object_group in seen or not 0 <= g.object_group <= 0xFFFF:
                raise Refused(
                    p.ErrorCode.INVALID, f"object group {g.object_group} is duplicated or out of range"
                )
            seen.add(g.object_group)
            m = LayoutManifest.from_dict(msgspec.structs.asdict(g.manifest))
            if m.chunk_size != opts.chunk_size:
                raise Refused(
                    p.ErrorCode.INVALID,
                    f"group {g.object_group}: the engine uses chunk size {m.chunk_size} but the server "
                    f"--chunk-size is {opts.chunk_size}; use the server's value (from hello)",
                )
            for what, block in (("manager", m.manager_block_size), ("kernel", m.kernel_block_size)):
                if block <= 0 or opts.chunk_size % block:
                    raise Refused(
                        p.ErrorCode.INVALID,
                        f"group {g.object_group}: --chunk-size {opts.chunk_size} is not a multiple of "
                        f"the engine's {what} block size {block}; use {block} or a multiple of it",
                    )
            if m.group_kind is GroupKind.SLIDING_WINDOW and not (m.sliding_window or 0) > 0:
                raise Refused(
                    p.ErrorCode.INVALID,
                    f"group {g.object_group}: a sliding-window group needs sliding_window > 0",
                )
            parsed.append((g.object_group, m))
        return parsed

    def record(self, fp: Fingerprint, group: int, manifest: LayoutManifest) -> p.GroupRef:
        """Remember a registered group (its manifest is stored); its reference for lookups."""
        with self._lock:
            self._specs[(fp.raw, group)] = self._spec(fp, group, manifest)
        return p.GroupRef(fp.raw, group)

    def known_fingerprints(self) -> set[bytes]:
        """The fingerprints registered with this server."""
        with self._lock:
            return {fp for fp, _ in self._specs}

    def resolve_known(self, refs: list[p.GroupRef]) -> list[GroupSpec] | None:
        """Group specs for ``refs`` if every one is known here already, else ``None`` (then
        :meth:`resolve` reads the manifests). No I/O: the request loop may call it."""
        with self._lock:
            specs = [self._specs.get((ref.fingerprint, ref.object_group)) for ref in refs]
        return None if None in specs else specs  # type: ignore[return-value]  # no None left: `in` does not narrow

    def resolve(self, refs: list[p.GroupRef]) -> list[GroupSpec]:
        """Group specs for ``refs``; I/O executor (may read a manifest from L2/L3)."""
        specs = []
        for ref in refs:
            with self._lock:
                spec = self._specs.get((ref.fingerprint, ref.object_group))
            if spec is None:
                fp = Fingerprint(ref.fingerprint)
                m = self._engine.manifest(fp)
                if m is None:
                    raise Refused(
                        p.ErrorCode.UNKNOWN_FINGERPRINT,
                        f"fingerprint {fp.hex} was never registered here; send register first",
                    )
                spec = self._spec(fp, ref.object_group, m)
                with self._lock:
                    self._specs[(ref.fingerprint, ref.object_group)] = spec
            specs.append(spec)
        return specs

    def _spec(self, fp: Fingerprint, group: int, m: LayoutManifest) -> GroupSpec:
        if m.group_kind is GroupKind.SLIDING_WINDOW:
            return GroupSpec.sliding(group, fp, m.sliding_window or 1, self._options.chunk_size)
        return GroupSpec(group, m.group_kind, fp)


def check_hashes(hashes: list[bytes]) -> None:
    """Refuse chunk hashes of the wrong length (``invalid``)."""
    if not set(map(len, hashes)) <= {HASH_BYTES}:  # the lengths gathered in C: 512 for 128k tokens
        bad = next(h for h in hashes if len(h) != HASH_BYTES)
        raise Refused(p.ErrorCode.INVALID, f"a chunk hash is {HASH_BYTES} bytes, got {len(bad)}")
