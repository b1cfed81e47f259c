"""vLLM's OpenAI-compatible server in a process of its own, and a small client for it.

:class:`OpenAIServer` runs a command (by default :func:`api_server_argv`: ``python -m
vllm.entrypoints.openai.api_server --model DIR ...``, the module form of ``vllm serve``, with vLLM's
multiprocess engine as ``vllm serve`` runs it) on a free port, with this checkout first on its
PYTHONPATH (so the connector under test is this tree's), its output in a log file, and waits for
``/health`` by polling. A process that dies fails the wait with the end of its log.

Its client methods send greedy requests (``temperature=0``, ``ignore_eos``) with logprobs and return a
:class:`Completion`: the text, each generated token's logprob and, when the server runs with
``--enable-prompt-tokens-details``, how many prompt tokens it did not compute
(``usage.prompt_tokens_details.cached_tokens``: vLLM's local prefix cache plus what a KV connector
loaded). :meth:`OpenAIServer.metric` reads a value of ``/metrics``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tiercache.testing.poll import wait_until

ROOT = Path(__file__).resolve().parents[2]
API_SERVER = "vllm.entrypoints.openai.api_server"

#: vLLM's counters of what KV connectors served, in prompt tokens (``v1/metrics/loggers.py``; the
#: Prometheus client adds ``_total`` to a counter's name).
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"


@dataclass(frozen=True)
class Completion:
    """One greedy completion: its text, the logprob of each generated token, the prompt's length in
    tokens and ``cached_tokens`` (``None`` when the server does not report prompt token details)."""

    text: str
    logprobs: list[float]
    prompt_tokens: int
    cached_tokens: int | None

    def max_logprob_diff(self, other: Completion) -> float:
        """The largest |logprob difference| of the two completions' tokens (same length required)."""
        assert len(self.logprobs) == len(other.logprobs), (len(self.logprobs), len(other.logprobs))
        return max((abs(a - b) for a, b in zip(self.logprobs, other.logprobs)), default=0.0)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tiny_model_flags(blocks: int) -> list[str]:
    """vLLM flags for the tests' tiny seeded checkpoints on CPU: float32, 32-token blocks, prefix
    caching, eager, seeded, a small host-memory share, vLLM's own KV cache capped at ``blocks``, and
    prompt token details in the usage (``cached_tokens``)."""
    return [
        "--dtype=float32",
        "--block-size=32",
        "--enable-prefix-caching",
        "--enforce-eager",
        "--seed=0",
        "--max-model-len=1024",
        "--gpu-memory-utilization=0.1",
        f"--num-gpu-blocks-override={blocks}",
        "--enable-prompt-tokens-details",
    ]


def api_server_argv(model: Path | str, *args: str, python: str = sys.executable) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server --model MODEL *args``: the command
    :class:`OpenAIServer` runs when given no other (it adds ``--host`` and ``--port``)."""
    return [python, "-m", API_SERVER, "--model", str(model), *args]


class OpenAIServer:
    """A vLLM OpenAI server process: ``argv`` plus ``--host 127.0.0.1 --port PORT`` (``argv`` must not
    name them), started at construction, ready after :meth:`wait_ready`, stopped by :meth:`stop` (or
    on leaving its ``with`` block, which also waits for readiness on entry).

    ``env`` is added to the environment (which loses ``VLLM_ENABLE_V1_MULTIPROCESSING`` and
    ``VLLM_CPU_KVCACHE_SPACE``: the engine runs as ``vllm serve`` runs it, sized by its flags).
    """

    def __init__(
        self,
        argv: Sequence[str],
        log: Path,
        *,
        env: Mapping[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        assert "--port" not in argv and "--host" not in argv, "OpenAIServer chooses the host and port"
        self._base_argv = list(argv)
        self._port_given = port is not None
        self.log = log
        environ = {
            k: v
            for k, v in os.environ.items()
            if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")
        }
        environ.update(
            HF_HUB_OFFLINE="1",
            PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [environ.get("PYTHONPATH")])]),
        )
        environ.update(env or {})  # may replace PYTHONPATH too (e.g. a test-only sitecustomize first)
        self._environ = environ
        log.parent.mkdir(parents=True, exist_ok=True)
        self._start(port or free_port())
        self.model = ""  # the served model's name, from /v1/models once ready

    def _start(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.argv = [*self._base_argv, "--host", "127.0.0.1", "--port", str(port)]
        self._log_start = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as out:
            # A session of its own: stop() can reach the engine core process vLLM forks, by group id.
            self.process = subprocess.Popen(
                self.argv,
                cwd=ROOT,
                env=self._environ,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._http = httpx.Client(base_url=self.url, timeout=120.0)

    def _lost_its_port(self) -> bool:
        """Whether the server exited because another process bound its port first: a port picked
        free here is bound by vLLM only after its imports, and another engine on the machine (the
        other CI shard's) may take it meanwhile."""
        if self._port_given or self.process.poll() is None:
            return False
        with self.log.open("rb") as f:
            f.seek(self._log_start)
            return b"Address already in use" in f.read()

    # -- life cycle --------------------------------------------------------------------------------
    def log_text(self) -> str:
        """Everything the server process has written so far."""
        return self.log.read_text(errors="replace")

    def log_tail(self, chars: int = 8000) -> str:
        """The end of the server's log (for failure messages)."""
        return self.log_text()[-chars:]

    def _healthy(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(
                f"vLLM's OpenAI server exited with {self.process.returncode} "
                f"(whole log: {self.log}):\n{self.log_tail()}"
            )
        try:
            return self._http.get("/health", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, timeout: float = 240.0) -> None:
        """Poll ``/health`` until it answers 200; fail with the log's end if the process exits. A
        server that lost the port picked for it to another process starts once more on a new one."""
        for attempt in (0, 1):
            try:
                wait_until(self._healthy, timeout=timeout, interval=0.25, what=f"{self.url}/health")
            except TimeoutError as exc:
                raise AssertionError(f"{exc}; the server's log ends:\n{self.log_tail()}") from exc
            except AssertionError:
                if attempt == 1 or not self._lost_its_port():
                    raise
                self.stop()
                self._start(free_port())
                continue
            break
        self.model = self._http.get("/v1/models").json()["data"][0]["id"]

    def stop(self, timeout: float = 30.0) -> int:
        """Terminate the server (SIGTERM: vLLM shuts its engine down), kill its process group if it
        is still there after ``timeout`` seconds; return its exit status."""
        self._http.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        try:  # an engine core the server left behind
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.process.returncode

    def __enter__(self) -> Self:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- requests ----------------------------------------------------------------------------------
    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self._http.post(path, json={"model": self.model, **body})
        assert r.status_code == 200, f"{path} answered {r.status_code}: {r.text}"
        data: dict[str, Any] = r.json()
        return data

    @staticmethod
    def _cached(usage: dict[str, Any]) -> int | None:
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        return None if cached is None else int(cached)

    def complete(self, prompt: str, max_tokens: int, **extra: Any) -> Completion:
        """``/v1/completions`` of ``prompt``: greedy, ``max_tokens`` tokens (``ignore_eos``), with
        each token's logprob; ``extra`` is added to the request body."""
        data = self._post(
            "/v1/completions",
            {
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 1,
                **extra,
            },
        )
        choice = data["choices"][0]
        return Completion(
            choice["text"],
            [float(x) for x in choice["logprobs"]["token_logprobs"]],
            int(data["usage"]["prompt_tokens"]),
            self._cached(data["usage"]),
        )

    def chat(self, content: str, max_tokens: int, **extra: Any) -> Completion:
        """``/v1/chat/completions`` of one user message ``content``, as :meth:`complete`."""
        data = self._post(
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": True,
                **extra,
            },
        )
        choice = data["choices"][0]
        return Completion(
            choice["message"]["content"] or "",
            [float(t["logprob"]) for t in choice["logprobs"]["content"]],
            int(data["usage"]["prompt_tokens"]),
            self._cached(data["usage"]),
        )

    def metrics(self) -> dict[str, float]:
        """Every sample of ``/metrics``, by sample name, summed over labels (e.g. :data:`EXTERNAL_HITS`)."""
        text = self._http.get("/metrics").text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
        return out

    def metric(self, name: str) -> float:
        """One sample of ``/metrics`` summed over its labels; a name the server does not export fails."""
        values = self.metrics()
        assert name in values, f"{name} is not exported; exported: {sorted(values)}"
        return values[name]
