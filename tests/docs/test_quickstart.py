"""docs/quickstart.md runs: every code block is executed (or explicitly skipped), so the page cannot rot.

Each block carries a marker comment (``<!-- quickstart: server|run|skip ... -->``). The ``server``
block's ``tiercache server`` is started as a real process in a temporary runtime and data directory,
with a small ``--l1-size-gb`` and a temporary ``--disk-path``; its ``pip install`` steps are not re-run
(the test checks instead that the ``tiercache`` command is installed). ``run`` blocks are run in that
environment in document order, must exit 0 and print every ``expect="..."`` text. ``skip`` blocks
(vLLM, the test suite itself) must say why.
"""

from __future__ import annotations

import os
import queue
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("tiercache.server")

from tests.docs.quickstart import (
    QUICKSTART,
    Block,
    cpu_vllm_block,
    fenced_bodies,
    parse_blocks,
    shell_commands,
)

READY_TIMEOUT_S = 60
BLOCK_TIMEOUT_S = 120


def test_every_block_of_the_quickstart_is_marked() -> None:
    blocks = parse_blocks(QUICKSTART.read_text())
    kinds = [b.kind for b in blocks]
    assert kinds.count("server") == 1 and kinds.index("server") == 0
    assert "run" in kinds
    assert any(b.lang == "python" and b.kind == "run" for b in blocks)
    skipped = [b for b in blocks if b.kind == "skip"]
    assert any("vLLM" in b.reason for b in skipped)


def test_the_quickstart_keeps_the_readme_set_up_command_and_both_vllm_configs() -> None:
    text = QUICKSTART.read_text()
    readme = (QUICKSTART.parents[1] / "README.md").read_text()
    server = next(b for b in parse_blocks(text) if b.kind == "server")
    assert server.body.strip() in readme  # the same command as the README's set-up
    vllm = [b.body for b in parse_blocks(text) if "vLLM" in b.reason]
    assert len(vllm) == 2  # CPU build and GPU build
    for body in vllm:
        assert '"kv_connector": "TierCacheConnector"' in body
        assert '"kv_connector_module_path": "tiercache.connector"' in body
        assert '"kv_role": "kv_both"' in body


def test_the_cpu_vllm_command_is_the_module_form_with_the_cpu_flags() -> None:
    """The CPU wheel's ``vllm`` console script cannot start (it asks for a distribution named
    ``vllm``), so the CPU block runs the module; tests/e2e/test_openai_server.py runs it as written."""
    commands = shell_commands(cpu_vllm_block(parse_blocks(QUICKSTART.read_text())).body)
    [serve] = [c for c in commands if "vllm.entrypoints.openai.api_server" in c]
    assert serve[:5] == [
        ".venv-vllm/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "MODEL",
    ]
    for flag in (
        "--enable-prefix-caching",
        "--block-size",
        "--gpu-memory-utilization",
        "--kv-transfer-config",
    ):
        assert flag in serve
    assert not any(c[0].endswith("vllm") for c in commands), "the CPU wheel's vllm command fails"


def test_vllm_md_gives_the_same_cpu_command_as_the_quickstart() -> None:
    quickstart = shell_commands(cpu_vllm_block(parse_blocks(QUICKSTART.read_text())).body)
    [serve] = [c for c in quickstart if "vllm.entrypoints.openai.api_server" in c]
    vllm_md = (QUICKSTART.parent / "vllm.md").read_text()
    quick_start = vllm_md[
        vllm_md.index("## Quick start") : vllm_md.index("\n## ", vllm_md.index("## Quick start"))
    ]
    documented = [c for body in fenced_bodies(quick_start) for c in shell_commands(body)]
    assert serve in documented
    assert any(c[:2] == ["vllm", "serve"] for c in documented)  # and the GPU wheel's command


class Server:
    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, name="quickstart-server-stderr", daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)

    def wait_ready(self) -> None:
        """Poll the log until the server says it is ready (never sleep)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            self.seen.append(line)
            if "tiercache server ready on" in line:
                return
        raise AssertionError("the quick start's server did not start:\n" + "".join(self.seen))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A clean environment: no TIERCACHE_* from the caller, temp runtime and data dirs, our tiercache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERCACHE_")}
    env["XDG_RUNTIME_DIR"] = str(tmp_path / "run")
    env["XDG_DATA_HOME"] = str(tmp_path / "data")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    (tmp_path / "run").mkdir(mode=0o700)
    return env


def server_argv(block: Block, tmp_path: Path) -> list[str]:
    """The block's ``tiercache server`` command, made small and temporary; install steps checked."""
    commands = [c.strip() for line in block.body.splitlines() for c in line.split("&&") if c.strip()]
    argv: list[str] | None = None
    for command in commands:
        words = shlex.split(command)
        if words[:2] == ["pip", "install"]:
            assert shutil.which("tiercache", path=str(Path(sys.executable).parent)), (
                "tiercache is not installed"
            )
        elif words[:2] == ["tiercache", "server"]:
            argv = [sys.executable, "-m", "tiercache.cli", *words[1:]]
        else:
            raise AssertionError(f"line {block.line}: unexpected command in the server block: {command!r}")
    assert argv is not None, f"line {block.line}: the server block does not start `tiercache server`"
    return [*argv, "--l1-size-gb", "0.03", "--disk-path", str(tmp_path / "disk"), "--disk-size-gb", "0.03"]


@pytest.fixture
def blocks() -> list[Block]:
    return parse_blocks(QUICKSTART.read_text())


def run_block(block: Block, env: dict[str, str], cwd: Path) -> str:
    if block.lang == "python":
        argv = [sys.executable, "-c", block.body]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", block.body]
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    out = done.stdout + done.stderr
    assert done.returncode == 0, (
        f"quickstart.md:{block.line} exited {done.returncode}:\n{block.body}\n---\n{out}"
    )
    for text in block.expect:
        assert text in out, f"quickstart.md:{block.line}: {text!r} not in the output:\n{out}"
    return out


@pytest.fixture
def server(blocks: list[Block], env: dict[str, str], tmp_path: Path) -> Iterator[Server]:
    block = next(b for b in blocks if b.kind == "server")
    srv = Server(server_argv(block, tmp_path), env)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_the_quickstart_runs_against_a_real_server(
    server: Server, blocks: list[Block], env: dict[str, str], tmp_path: Path
) -> None:
    ran = [run_block(b, env, tmp_path) for b in blocks if b.kind == "run"]
    assert ran
    assert server.proc.poll() is None, "the server died during the quick start"
