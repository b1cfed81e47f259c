"""A minimal prefill/decode proxy for vLLM OpenAI servers that share one tiercache server.

For each ``POST /v1/completions`` or ``/v1/chat/completions`` it sends the request to the prefill
engine (``kv_role: kv_producer``) with ``max_tokens=1`` (so that engine computes the prompt and its
connector stores every full chunk), then at once the original request to the decode engine
(``kv_consumer``), whose connector loads those chunks (waiting for stores still in flight) and which
computes only the rest; the decode engine's response is returned. Non-streaming requests only.
This is the shape of vLLM's own disaggregated-serving proxies, reduced to what the tests and the
recipe in docs/vllm.md need::

    python -m tests.e2e.pd_proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

ROUTES = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill engine gets: the same prompt, one token (max_completion_tokens too, for chat)."""
    out = {**body, "max_tokens": 1, "stream": False}
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


class PDProxy:
    """Serves on ``port`` (127.0.0.1) in a background thread until :meth:`close`."""

    def __init__(self, prefill: str, decode: str, port: int = 0, timeout: float = 300.0) -> None:
        self.prefill = httpx.Client(base_url=prefill, timeout=timeout)
        self.decode = httpx.Client(base_url=decode, timeout=timeout)
        self.prefills = 0  # requests the prefill engine answered
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                if self.path not in ROUTES:
                    self._reply(
                        404, b'{"error": "the proxy serves /v1/completions and /v1/chat/completions"}'
                    )
                    return
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                first = proxy.prefill.post(self.path, json=prefill_body(body))
                if first.status_code != 200:
                    self._reply(first.status_code, first.content)
                    return
                proxy.prefills += 1
                second = proxy.decode.post(self.path, json=body)
                self._reply(second.status_code, second.content)

            def _reply(self, status: int, content: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            def log_message(self, format: str, *args: Any) -> None:
                return  # quiet: the engines log each request

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="pd-proxy", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.prefill.close()
        self.decode.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prefill", required=True, help="URL of the prefill engine's OpenAI server")
    parser.add_argument("--decode", required=True, help="URL of the decode engine's OpenAI server")
    parser.add_argument("--port", type=int, default=8000, help="port to serve on, 127.0.0.1 (default 8000)")
    args = parser.parse_args()
    proxy = PDProxy(args.prefill, args.decode, args.port)
    print(f"prefill/decode proxy on {proxy.url} -> {args.prefill} then {args.decode}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        proxy.close()


if __name__ == "__main__":
    main()
