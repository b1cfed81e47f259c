"""OpenAIServer, the end-to-end tests' handle on vLLM's OpenAI server process (a stand-in HTTP server
here, no vLLM needed): vLLM binds the port picked for it only after its imports, and another engine
on the machine (the other CI shard's) may take that port first; the server then starts once more
on a new one. Any other failure to start is reported, never retried."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("httpx", reason="httpx comes with vLLM's environment (CI runs these in .venv-vllm)")

from tests.e2e import openai_server
from tests.e2e.openai_server import OpenAIServer

# Serves /health and /v1/models on --host/--port as vLLM's server does; says what bind() said
# and exits 1 when the port is taken, as vLLM's does.
STAND_IN = r"""
import argparse, json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--host")
parser.add_argument("--port", type=int)
parser.add_argument("--fail", action="store_true")
args = parser.parse_args()
if args.fail:
    print("no model here", flush=True)
    sys.exit(3)


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": [{"id": "stand-in"}]} if self.path == "/v1/models" else {}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass


try:
    server = HTTPServer((args.host, args.port), Handler)
except OSError as exc:
    print(exc, flush=True)
    sys.exit(1)
print("serving", flush=True)
server.serve_forever()
"""


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A port another process holds, which the next port picked free here will be."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = int(holder.getsockname()[1])
        first = iter([port])
        pick = openai_server.free_port
        monkeypatch.setattr(openai_server, "free_port", lambda: next(first, None) or pick())
        yield port


def test_a_server_whose_port_was_taken_meanwhile_starts_again_on_another(tmp_path: Path, taken: int) -> None:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    log = tmp_path / "server.log"
    with OpenAIServer([sys.executable, str(script)], log) as server:
        assert server.port != taken
        assert server.model == "stand-in"
    text = log.read_text()
    assert "Address already in use" in text and text.count("serving") == 1


def test_a_server_that_fails_for_another_reason_is_not_started_again(tmp_path: Path, taken: int) -> None:
    del taken  # the first port is taken too, but that is not why this one fails
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    log = tmp_path / "server.log"
    server = OpenAIServer([sys.executable, str(script), "--fail"], log)
    with pytest.raises(AssertionError, match="exited with 3"):
        server.wait_ready(timeout=30)
    server.stop()
    assert log.read_text().count("no model here") == 1
