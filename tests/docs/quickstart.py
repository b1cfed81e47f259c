"""docs/quickstart.md's code blocks, parsed: their markers, and their shell commands as argv lists.

Shared by tests/docs/test_quickstart.py (which runs the page against a real server) and
tests/e2e/test_openai_server.py (which runs the CPU vLLM command as written).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

QUICKSTART = Path(__file__).resolve().parents[2] / "docs" / "quickstart.md"

#: The quickstart's placeholders in its vLLM commands, which a test substitutes (and nothing else).
MODEL_PLACEHOLDER = "MODEL"
SOCKET_PLACEHOLDER = "unix:///run/user/1000/tiercache/server.sock"

_BLOCK = re.compile(
    r"(?:<!--\s*quickstart:\s*(?P<marker>[^>]*?)\s*-->\s*\n)?```(?P<lang>\w*)[^\n]*\n(?P<body>.*?)^```",
    re.DOTALL | re.MULTILINE,
)


@dataclass(frozen=True)
class Block:
    """One fenced code block: its marker's kind (``server``, ``run`` or ``skip``), language, text,
    ``expect="..."`` texts, the rest of the marker (a skip's reason) and its line in the page."""

    kind: str
    lang: str
    body: str
    expect: tuple[str, ...]
    reason: str
    line: int


def parse_blocks(text: str, page: str = QUICKSTART.name) -> list[Block]:
    """Every fenced block of the page, with its marker (a block without one is an error)."""
    text = re.sub(
        r"<!--(?!\s*quickstart:).*?-->", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.DOTALL
    )
    blocks = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("lang")) + 1
        marker = m.group("marker")
        if marker is None:
            raise AssertionError(f"{page}:{line}: code block without a <!-- quickstart: ... --> marker")
        kind = marker.split()[0]
        assert kind in ("server", "run", "skip"), f"{page}:{line}: unknown marker {marker!r}"
        reason = marker[len(kind) :].strip()
        if kind == "skip":
            assert reason.startswith("(") and reason.endswith(")"), f"{page}:{line}: a skip says why"
        blocks.append(
            Block(
                kind,
                m.group("lang"),
                m.group("body"),
                tuple(re.findall(r'expect="([^"]*)"', marker)),
                reason,
                line,
            )
        )
    return blocks


def fenced_bodies(text: str) -> list[str]:
    """The text of every fenced code block of a page without markers (e.g. docs/vllm.md)."""
    return [m.group("body") for m in _BLOCK.finditer(text)]


def shell_commands(body: str) -> list[list[str]]:
    """A shell block's commands, one argv per command, as bash would split them: a line ending in
    a backslash continues (outside quotes), a quoted string may span lines, ``#`` comments are
    dropped. (Pipes, ``&&`` and redirections stay words: the callers check the commands they expect.)"""
    commands: list[list[str]] = []
    pending = ""
    for line in body.splitlines():
        pending += line + "\n"
        if line.endswith("\\"):
            continue
        try:
            words = shlex.split(pending.replace("\\\n", " "), comments=True)  # (not inside quotes)
        except ValueError:  # an open quote: the command goes on on the next line
            continue
        if words:
            commands.append(words)
        pending = ""
    assert not pending.strip(), f"unterminated command: {pending!r}"
    return commands


def cpu_vllm_block(blocks: list[Block]) -> Block:
    """The quickstart's CPU vLLM block: the one skip block the e2e suite runs as written."""
    [block] = [b for b in blocks if "tests/e2e/test_openai_server.py" in b.reason]
    return block
