"""The shared start of the vLLM e2e modules: a tiny seeded model, its prompts, a real tiercache server
and one cold engine run through it; and fresh engine processes against that server.

Each engine runs in its own process (``tests/e2e/engine_run.py`` or a launcher wrapping it), so every
run is a *fresh* engine with an empty local prefix cache: any cached prompt token it reports came
from tiercache. The engine's PYTHONPATH starts with this checkout, so the connector under test is
this tree's, whatever tiercache the venv has installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol, Self

from tests.e2e.engine_run import make_prompts
from tests.server.serverproc import ServerProcess, ServerSpec
from tiercache.testing.poll import wait_until

ROOT = Path(__file__).resolve().parents[2]
ENGINE_RUN = "tests.e2e.engine_run"
LOAD_FAILURE_RUN = "tests.e2e.load_failure_run"
MiB = 1 << 20
#: How long an e2e server's lookup waits for the bucket (its ``remote_lookup_budget_s``; default 1 s)
#: and for one existence check there (``head_timeout_s``; default 0.5 s). These tests claim what a
#: lookup finds in S3, not how fast: on a loaded CI machine a first answer can take longer than the
#: defaults, and the lookup then misses (rightly; tests/reliability/test_s3_outage.py holds them).
S3_PATIENCE_S = 5.0
#: A :class:`ServerSpec`'s options for that (read-only: spread them into its ``s3_options`` and
#: ``engine_options``).
PATIENT_S3 = MappingProxyType({"head_timeout_s": S3_PATIENCE_S})
PATIENT_LOOKUPS = MappingProxyType({"remote_lookup_budget_s": S3_PATIENCE_S})


@dataclass
class Run:
    """What one engine process generated: greedy tokens, their logprobs, vLLM's count of prompt
    tokens it did not compute, tiercache's ``vllm:tiercache_*`` metrics (with ``log_stats``) and the
    process's output."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    num_cached: list[int]
    metrics: dict[str, float] = field(default_factory=dict)
    log: str = ""

    def max_logprob_diff(self, other: Run) -> float:
        """The largest |logprob difference| between the two runs, over every prompt and token."""
        return max(abs(a - b) for p, q in zip(self.logprobs, other.logprobs) for a, b in zip(p, q))


def run_engine(
    model: Path,
    server: str,
    prompts_file: Path,
    out: Path,
    *,
    module: str = ENGINE_RUN,
    launcher_args: Sequence[str] = (),
    multiprocess: bool = False,
    engine_args: dict[str, Any] | None = None,
    extra_path: Path | None = None,
    log_stats: bool = False,
    connector_config: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> Run:
    """Run one engine process (``python -m module``); ``launcher_args`` go before engine_run's own
    (e.g. ``load_failure_run``'s), ``extra_path`` is prepended to its PYTHONPATH (e.g. an import
    stub), ``env`` is added to its environment (and so to its ``mp`` executor's worker processes,
    e.g. ``VLLM_CPU_OMP_THREADS_BIND`` for tensor parallelism). A failed process fails the test with
    the end of its stderr (the whole output is kept next to ``out`` as ``.log``)."""
    environ = dict(os.environ)
    environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # engine_run sizes the KV cache itself
    environ.update(
        # In-process unless asked: a launcher's patches must be in the engine's process.
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(
            [*([str(extra_path)] if extra_path else []), str(ROOT), environ.get("PYTHONPATH", "")]
        ),
        **(env or {}),
    )
    cmd = [
        sys.executable,
        "-m",
        module,
        *launcher_args,
        "--model",
        str(model),
        "--server",
        server,
        "--prompts",
        str(prompts_file),
        "--out",
        str(out),
        "--engine-args",
        json.dumps(engine_args or {}),
        *(["--log-stats"] if log_stats else []),
        "--connector-config",
        json.dumps(connector_config or {}),
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=240, check=False
    )
    if proc.returncode != 0:
        log = out.with_suffix(".log")  # the whole output: the message keeps only its end
        log.write_text(proc.stdout + proc.stderr)
        raise AssertionError(
            f"engine run failed ({proc.returncode}; whole log: {log}):\n{proc.stderr[-6000:]}"
        )
    data: dict[str, Any] = json.loads(out.read_text())
    return Run(
        data["tokens"],
        data["logprobs"],
        data["num_cached"],
        data.get("metrics", {}),
        proc.stdout + proc.stderr,
    )


def cli_json(*args: str, timeout: float = 60) -> dict[str, Any]:
    """``tiercache ARGS`` (which must include ``--json``) run as the CLI from this checkout; its JSON."""
    done = subprocess.run(
        [sys.executable, "-m", "tiercache.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def engine_stats(server: ServerProcess) -> dict[str, int]:
    """The server engine's counters (stores, lookup hits, tier writes, promotions, ...)."""
    with server.client() as c:
        return c.stats()["engine"]


def wait_for(server: ServerProcess, counter: str, at_least: int, deadline_s: float = 30.0) -> int:
    """Poll the engine counter ``counter`` until it reaches ``at_least`` or the deadline passes, and
    return its value: the last stores of a run (and the tier writes behind them) may still be
    committing when its process exits, so poll, don't sleep."""
    try:
        wait_until(
            lambda: engine_stats(server)[counter] >= at_least,
            timeout=deadline_s,
            interval=0.05,
            what=f"{counter} >= {at_least}",
        )
    except TimeoutError:
        pass  # the caller's assertion on the value says what is missing
    return int(engine_stats(server)[counter])


def wait_for_stores(server: ServerProcess, at_least: int, deadline_s: float = 30.0) -> int:
    """:func:`wait_for` the server's ``stores``."""
    return wait_for(server, "stores", at_least, deadline_s)


class ModelWriter(Protocol):
    """Writes a tiny checkpoint with weights drawn from ``seed`` into ``directory``."""

    def __call__(self, directory: Path, *, seed: int) -> None: ...


@dataclass
class Setup:
    """A module's model, prompts, server and cold run; a module adds its own fields in a
    ``@dataclass(kw_only=True)`` subclass built with :meth:`of`."""

    tmp: Path
    model: Path
    prompts: Path  # the prompts file engine_run reads
    prompt_ids: list[list[int]]
    server: ServerProcess
    cold: Run
    name: str = ""  # which model, for parametrized modules and their printed lines
    engine_args: dict[str, Any] = field(default_factory=dict)  # every run's LLM() overrides
    extra_path: Path | None = None  # prepended to every run's PYTHONPATH
    log_stats: bool = False  # every run reports vLLM's stats
    env: dict[str, str] = field(default_factory=dict)  # added to every run's environment
    module: str = (
        ENGINE_RUN  # every run's engine module (a launcher wrapping engine_run, e.g. seeded_dummy_run)
    )
    connector_config: dict[str, Any] = field(default_factory=dict)  # every run's connector settings

    @classmethod
    def of(cls, base: Setup, **extra: Any) -> Self:
        """``base`` with a module's own fields added (``cls`` is that module's subclass)."""
        return cls(**{f.name: getattr(base, f.name) for f in fields(Setup)}, **extra)

    def run(
        self,
        out: str,
        *,
        model: Path | None = None,
        server: str | None = None,
        module: str | None = None,
        launcher_args: Sequence[str] = (),
        multiprocess: bool = False,
        connector_config: dict[str, Any] | None = None,
    ) -> Run:
        """A fresh engine on this setup's prompts (by default also its model and server, and always
        its engine args, PYTHONPATH addition, environment and stats), writing ``{out}.json`` in its temp dir;
        ``module`` defaults to the setup's; ``connector_config`` is added to the connector's settings."""
        return run_engine(
            model or self.model,
            server or self.server.endpoint,
            self.prompts,
            self.tmp / f"{out}.json",
            module=module or self.module,
            launcher_args=launcher_args,
            multiprocess=multiprocess,
            engine_args=self.engine_args,
            extra_path=self.extra_path,
            log_stats=self.log_stats,
            connector_config={**self.connector_config, **(connector_config or {})},
            env=self.env,
        )

    def run_counting_hits(self, out: str, **kw: Any) -> tuple[Run, int]:
        """:meth:`run` (same arguments), and how many chunk hits the server counted meanwhile."""
        before = engine_stats(self.server)["lookup_chunks_hit"]
        run = self.run(out, **kw)
        return run, engine_stats(self.server)["lookup_chunks_hit"] - before


@contextmanager
def cold_setup(
    tmp: Path,
    write_model: ModelWriter,
    lengths: list[int],
    *,
    chunk: int,
    name: str = "",
    seed: int = 1234,
    prompt_seed: int = 7,
    engine_args: dict[str, Any] | None = None,
    extra_path: Path | None = None,
    log_stats: bool = False,
    spec: ServerSpec | None = None,
    wait_for_stored: int = 0,
    env: dict[str, str] | None = None,
    module: str = ENGINE_RUN,
    connector_config: dict[str, Any] | None = None,
) -> Iterator[Setup]:
    """Write the model (``write_model`` with ``seed``) and prompts of ``lengths`` tokens
    (``make_prompts`` with ``prompt_seed``) under ``tmp``, start a server (``spec``; by default L1
    only, 64 MiB, chunk ``chunk``), run the cold engine through it and, with ``wait_for_stored``,
    wait for that many stores (not checked: a module that counts them asserts it). ``engine_args``,
    ``extra_path``, ``log_stats``, ``env``, ``module`` (the engine module, e.g. a launcher) and
    ``connector_config`` (connector settings) apply to the cold run and to every :meth:`Setup.run`.
    The server stops when the context ends."""
    model = tmp / "model"
    write_model(model, seed=seed)
    ids = make_prompts(lengths, seed=prompt_seed)
    prompts = tmp / "prompts.json"
    prompts.write_text(json.dumps(ids))
    server = ServerProcess(
        spec
        or ServerSpec(listen=f"ipc://{tmp}/server.sock", l1_bytes=64 * MiB, options={"chunk_size": chunk})
    )
    try:
        server.wait_ready()
        cold = run_engine(
            model,
            server.endpoint,
            prompts,
            tmp / "cold.json",
            engine_args=engine_args,
            extra_path=extra_path,
            log_stats=log_stats,
            env=env,
            module=module,
            connector_config=connector_config,
        )
        if wait_for_stored:
            wait_for_stores(server, wait_for_stored)
        yield Setup(
            tmp,
            model,
            prompts,
            ids,
            server,
            cold,
            name,
            dict(engine_args or {}),
            extra_path,
            log_stats,
            dict(env or {}),
            module,
            dict(connector_config or {}),
        )
    finally:
        server.stop()
