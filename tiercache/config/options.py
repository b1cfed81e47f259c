"""The machinery of the option table: how a config field becomes a flag, a variable and a file key,
and how a raw value from any of them is parsed.

:func:`build_options` derives one :class:`Option` per field of each part config (see
:mod:`tiercache.config.table` for the table itself): its TOML key, its ``--flag``, its
``TIERCACHE_*`` variable, its kind, unit and default. :func:`parse_value` turns a string (flag,
variable) or a TOML value into the field's type, with one-line errors naming where the value came
from (:class:`Origin`), the value (never a secret) and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import tomllib
import typing
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercache.config.units import GiB, MiB
from tiercache.config.values import parse_bool, parse_tier_list
from tiercache.errors import ConfigError

#: Environment variable naming a config file (the ``--config`` flag wins over it).
CONFIG_ENV = "TIERCACHE_CONFIG"

ENV_PREFIX = "TIERCACHE_"


class Unit(enum.Enum):
    """A user-facing unit: the option takes a decimal number of these; the field stores bytes."""

    GIB = ("GiB", GiB)
    MIB = ("MiB", MiB)

    @property
    def label(self) -> str:
        return self.value[0]

    @property
    def factor(self) -> int:
        return self.value[1]


@dataclass(frozen=True, slots=True)
class Meta:
    """What the dataclass field cannot say about itself."""

    help: str
    name: str | None = None  # key in its TOML table; default: the field name
    flag: str | None = None  # default: --<section prefix><name with dashes>
    unit: Unit | None = None
    default_text: str | None = None  # for defaults computed at run time
    metavar: str | None = None
    secret: bool = False


@dataclass(frozen=True, slots=True)
class Option:
    """One setting, and every name it goes by.

    ``key`` is its TOML key (``"l1.size_gb"`` means ``size_gb`` in the ``[l1]`` table; top-level keys
    have no dot). ``kind`` is the value's base type (``int``, ``float``, ``bool``, ``str``, ``Path``,
    an enum, or ``tuple`` for the tier list); ``unit`` converts a decimal number of GiB/MiB to the
    field's bytes.
    """

    key: str
    section: str
    field: str
    flag: str
    env: str
    kind: type
    optional: bool
    unit: Unit | None
    default: Any  # in user units; None when there is none
    default_text: str
    help: str
    metavar: str | None
    secret: bool

    @property
    def toml_name(self) -> str:
        return self.key.rpartition(".")[2]

    @property
    def dest(self) -> str:
        """The argparse destination for its flag."""
        return self.key.replace(".", "__")

    @property
    def choices(self) -> tuple[str, ...] | None:
        if isinstance(self.kind, type) and issubclass(self.kind, enum.Enum):
            return tuple(str(m.value) for m in self.kind)
        return None

    def to_field(self, value: Any) -> Any:
        """A parsed user value → the dataclass field's value (GiB → bytes)."""
        if self.unit is not None and value is not None:
            return round(value * self.unit.factor)
        return value


def format_default(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _base_type(annotation: Any) -> tuple[type, bool]:
    """``int | None`` → ``(int, True)``; ``tuple[str, ...]`` → ``(tuple, False)``."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin is tuple:
        return tuple, False
    if args and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return inner, True
    return annotation, False


def _options_of(
    section: str, cls: type, prefix: str, meta_table: Mapping[tuple[str, str], Meta]
) -> Iterator[Option]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = meta_table.get((section, f.name))
        if meta is None:
            raise RuntimeError(  # a programming error caught by the test suite, not a user error
                f"{cls.__name__}.{f.name} has no entry in tiercache.config.table.META; document it there"
            )
        name = meta.name or f.name
        flag = meta.flag or f"--{prefix}{name.replace('_', '-')}"
        kind, optional = _base_type(hints[f.name])
        if meta.unit is not None:
            kind = float  # sizes take decimals (0.5 GiB); to_field rounds to whole bytes
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        if meta.unit is not None and isinstance(default, int):
            default = default / meta.unit.factor
        text = meta.default_text or ("none" if default is None else format_default(default))
        yield Option(
            key=f"{section}.{name}" if section else name,
            section=section,
            field=f.name,
            flag=flag,
            env=ENV_PREFIX + flag[2:].upper().replace("-", "_"),
            kind=kind,
            optional=optional,
            unit=meta.unit,
            default=default,
            default_text=text,
            help=meta.help,
            metavar=meta.metavar,
            secret=meta.secret,
        )


def build_options(
    sections: Collection[tuple[str, type, str]], meta: Mapping[tuple[str, str], Meta]
) -> tuple[Option, ...]:
    """One :class:`Option` per field of each ``(section, config class, flag prefix)``, in order."""
    return tuple(opt for section, cls, prefix in sections for opt in _options_of(section, cls, prefix, meta))


# -- parsing values --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a value came from, for error messages: a flag, a variable or a file key."""

    kind: str  # "flag" | "env" | "file"
    name: str  # "--l1-size-gb", "TIERCACHE_L1_SIZE_GB", "l1.size_gb"
    path: Path | None = None

    def show(self, raw: Any, secret: bool = False) -> str:
        """``--x 5``, ``TIERCACHE_X=5``, or ``x = 5 in FILE``; secrets as ``***``."""
        value = "***" if secret else (raw if isinstance(raw, str) else repr(raw))
        if self.kind == "flag":
            return f"{self.name} {value}"
        if self.kind == "env":
            return f"{self.name}={value}"
        return f"{self.name} = {value!r} in {self.path}" if not secret else f"{self.name} in {self.path}"

    def label(self) -> str:
        """The name alone: ``--x``, ``TIERCACHE_X``, or ``x (in FILE)``."""
        return self.name if self.kind != "file" else f"{self.name} (in {self.path})"


def parse_value(opt: Option, raw: Any, origin: Origin) -> Any:
    """Turn a flag/env string or a TOML value into ``opt``'s user-unit value, or raise ConfigError."""
    where = origin.show(raw, opt.secret)

    def fail(what: str, fix: str) -> ConfigError:
        return ConfigError(f"{where} is not {what}; {fix}")

    kind = opt.kind
    if kind is tuple:
        if not isinstance(raw, str | list):
            raise fail("a tier list", "use e.g. l1,disk,s3")
        return parse_tier_list(raw, origin.label())
    if kind is bool:
        flag = parse_bool(raw) if isinstance(raw, bool | str) else None
        if flag is None:
            raise fail("a boolean", "use true or false (or 1/0, yes/no, on/off)")
        return flag
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        choices = opt.choices or ()
        text = raw.strip().lower() if isinstance(raw, str) else raw
        if text not in choices:
            raise fail("a valid choice", f"use one of {', '.join(choices)}")
        return kind(text)
    if kind is int:
        if isinstance(raw, bool) or not isinstance(raw, int | str):
            raise fail("an integer", f"use a whole number, e.g. {format_default(opt.default or 1)}")
        try:
            value: Any = int(raw)
        except ValueError:
            raise fail("an integer", f"use a whole number, e.g. {format_default(opt.default or 1)}") from None
    elif kind is float:
        if isinstance(raw, bool) or not isinstance(raw, int | float | str):
            raise fail("a number", f"use a decimal number, e.g. {format_default(opt.default or 1)}")
        try:
            value = float(raw)
        except ValueError:
            raise fail("a number", f"use a decimal number, e.g. {format_default(opt.default or 1)}") from None
        if not math.isfinite(value):
            raise fail("a finite number", f"use a decimal number, e.g. {format_default(opt.default or 1)}")
    elif kind is str or kind is Path:
        if not isinstance(raw, str):
            raise fail("a string", "quote the value")
        return kind(raw) if kind is Path else raw
    else:  # pragma: no cover - the table only holds the kinds above
        raise RuntimeError(f"no parser for {opt.key} of type {kind!r}")
    if opt.unit is not None and not value > 0:
        raise ConfigError(f"{where} is not a positive size; give a number of {opt.unit.label} > 0, e.g. 0.5")
    return value


def nearest(name: str, candidates: list[str]) -> str:
    found = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    if not found:  # flat keys such as l1_size_gb: compare with the dots taken out
        flat = {c.replace(".", "_"): c for c in candidates}
        hit = difflib.get_close_matches(name.replace(".", "_"), list(flat), n=1, cutoff=0.5)
        found = [flat[hit[0]]] if hit else []
    return f"; did you mean {_show_key(found[0])}?" if found else ""


def _show_key(key: str) -> str:
    table, _, name = key.rpartition(".")
    return f"[{table}] {name}" if table else name


def read_config_file(path: Path, options: Mapping[str, Option]) -> dict[str, tuple[Any, Origin]]:
    """Read a TOML config file into ``{option key: (value, origin)}``; unknown keys are errors."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; fix --config / {CONFIG_ENV}") from None
    except OSError as exc:
        raise ConfigError(
            f"cannot read config file {path}: {exc.strerror}; check its permissions, or fix --config / {CONFIG_ENV}"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}; fix the syntax") from None
    sections = {opt.section for opt in options.values() if opt.section}
    found: dict[str, tuple[Any, Origin]] = {}
    for name, value in data.items():
        if isinstance(value, dict) and name in sections:
            for sub, subvalue in value.items():
                key = f"{name}.{sub}"
                found[key] = (subvalue, Origin("file", key, path))
        else:
            found[name] = (value, Origin("file", name, path))
    for key in found:
        if key not in options:
            raise ConfigError(
                f"config file {path}: unknown key {_show_key(key)}{nearest(key, list(options))} "
                "(see docs/configuration.md)"
            )
    return found
