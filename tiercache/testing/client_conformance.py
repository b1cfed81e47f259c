"""Fakes of the client that cannot drift from it: every method a fake defines under the name of a
public method of :class:`~tiercache.client.client.Client` must accept every call the real one
accepts, and require nothing the real one does not.

Tests stand fakes in for the client (a lookup client that answers from a script, a residency log
the test writes); when the client's API moves on, a fake that still takes the old signature keeps
its tests green while the code under test calls the real one differently. Run
:func:`assert_conforms` on each fake in the tests that use it; :func:`signature_drift` says what
differs. Signatures only: what a fake answers is the test's business.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from tiercache.client.client import Client

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def signature_drift(fake: type, real: type = Client) -> list[str]:
    """What about ``fake``'s methods named like ``real``'s public ones would refuse a call the real
    method accepts (one line each; empty: none)."""
    problems: list[str] = []
    for name, member in inspect.getmembers(fake):
        if name.startswith("_") or not callable(member):
            continue
        original = inspect.getattr_static(real, name, None)
        if original is None or isinstance(original, property) or not callable(getattr(real, name)):
            continue
        problems += [f"{fake.__name__}.{name}: {p}" for p in _refusals(member, getattr(real, name))]
    return problems


def assert_conforms(*fakes: type, real: type = Client) -> None:
    """Raise :class:`AssertionError` naming every drift of ``fakes`` from ``real``."""
    problems = [p for fake in fakes for p in signature_drift(fake, real)]
    assert not problems, "fakes drifted from the client:\n  " + "\n  ".join(problems)


def _refusals(fake: Callable[..., Any], real: Callable[..., Any]) -> list[str]:
    mine = _params(fake)
    theirs = _params(real)
    var_pos = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in mine)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in mine)
    positional = [p for p in mine if p.kind in _POSITIONAL]
    by_name = {p.name: p for p in mine if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    out: list[str] = []
    for i, p in enumerate(q for q in theirs if q.kind in _POSITIONAL):
        if i < len(positional):
            if (
                p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
                and positional[i].name != p.name
                and not var_kw
            ):
                out.append(f"argument {i + 1} is {positional[i].name!r}, the client's {p.name!r}")
        elif not var_pos:
            out.append(f"takes no argument {i + 1} ({p.name!r})")
    for p in theirs:
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in by_name and not var_kw:
            out.append(f"takes no keyword {p.name!r}")
        if p.kind is inspect.Parameter.VAR_POSITIONAL and not var_pos:
            out.append("takes no *args")
        if p.kind is inspect.Parameter.VAR_KEYWORD and not var_kw:
            out.append("takes no **kwargs")
    required = {p.name for p in theirs if p.default is inspect.Parameter.empty}
    for p in mine:
        if p.default is inspect.Parameter.empty and p.kind not in _VAR and p.name not in required:
            out.append(f"requires {p.name!r}, which the client does not")
    return out


_VAR = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _params(method: Callable[..., Any]) -> list[inspect.Parameter]:
    params = list(inspect.signature(method).parameters.values())
    return params[1:] if params and params[0].name == "self" else params


__all__ = ["assert_conforms", "signature_drift"]
