"""Byte units: the constants, the one parser of user-given sizes and the two ways sizes are shown.

Used by every layer (the arena's error messages, the configuration summary, the CLI's tables), so it
depends on nothing but the error tree.
"""

from __future__ import annotations

from tiercache.errors import ConfigError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

_UNITS = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


def format_bytes(n: float) -> str:
    """An amount of bytes for people, to one decimal: ``512 B``, ``1.5 KiB``, ``3.2 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def format_size(n: int) -> str:
    """An exact size in the largest unit that divides it: ``256 KiB``, ``4 MiB``, ``1000 B``."""
    for unit, scale in _UNITS:
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def parse_size(text: str) -> int:
    """``"256k"``, ``"4m"``, ``"1.5g"``, ``"1048576"`` → bytes (binary units; ``KiB``/``kb`` too)."""
    units = {"k": KiB, "m": MiB, "g": GiB, "t": TiB}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError as exc:
        raise ConfigError(f"{text!r} is not a size; use e.g. 256k, 1m or 4m") from exc
