"""What the CLI prints, in one place: byte amounts, JSON documents, tables and progress.

Results go to stdout (a table, or one JSON document with ``--json``); progress and notes go to
stderr, so a pipe or a script reading stdout never sees them. Escape codes are written only to a
terminal.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Self, TextIO

from tiercache.config.units import format_bytes, format_size

__all__ = ["Progress", "console", "format_bytes", "format_size", "print_json"]


def print_json(data: Any) -> None:
    """``data`` as one indented JSON document on stdout."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def console() -> Any:
    """A ``rich`` console on stdout for tables."""
    from rich.console import Console

    # A pipe or a file gets wide lines rather than folded hex (80 columns is rich's default there).
    return Console(file=sys.stdout, width=None if sys.stdout.isatty() else 200, highlight=False)


class Progress:
    """Progress of a long operation on ``stream`` (stderr): a ``rich`` bar per step when
    ``enabled`` (a terminal), nothing otherwise but the :meth:`note` lines. A context manager."""

    def __init__(self, enabled: bool, stream: TextIO | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self._bar: Any = None

    @classmethod
    def for_terminal(cls, as_json: bool, stream: TextIO | None = None) -> Progress:
        """Enabled when ``stream`` (default stderr) is a terminal and the output is not JSON."""
        stream = sys.stderr if stream is None else stream
        return cls(enabled=not as_json and stream.isatty(), stream=stream)

    def __enter__(self) -> Self:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                TaskProgressColumn,
                TextColumn,
                TimeElapsedColumn,
            )
            from rich.progress import Progress as Bar

            self._bar = Bar(
                TextColumn("{task.description}"),
                BarColumn(),
                TaskProgressColumn(),
                TextColumn("{task.fields[done]}"),
                TimeElapsedColumn(),
                console=Console(file=self.stream, force_terminal=True),
            )
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def note(self, text: str) -> None:
        """A line of context: above the bar on a terminal, a plain line otherwise."""
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def step(self, description: str, total: float | None) -> int | None:
        """Start a step of ``total`` units (``None``: unknown, a pulsing bar); its task id."""
        if self._bar is None:
            return None
        return int(self._bar.add_task(description, total=total, done=""))

    def describe(self, task: int | None, description: str) -> None:
        """Say what ``task`` is doing now."""
        if self._bar is not None and task is not None:
            self._bar.update(task, description=description)

    def advance(self, task: int | None, n: float, done: str) -> None:
        """``n`` more units of ``task`` done; ``done`` says how much in words."""
        if self._bar is not None and task is not None:
            self._bar.update(task, advance=n, done=done)

    def finish(self, task: int | None, done: str) -> None:
        """Mark ``task`` complete (the total was an estimate: fill the bar)."""
        if self._bar is not None and task is not None:
            units = self._bar.tasks[task].completed or 1  # task ids are positions in ``tasks``
            self._bar.update(task, total=units, completed=units, done=done)
