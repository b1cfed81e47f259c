"""Helpers shared by the reliability scenarios: checked payloads, figures, an S3 fault proxy.

Every payload is derived from its key (:func:`payload`), so any byte a scenario reads back is checked
against the key it asked for: a wrong read cannot hide. Each scenario prints one ``FIGURES`` line
(visible with ``pytest -s``) that docs/reliability.md copies.
"""

from __future__ import annotations

import http.client
import os
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tiercache.keys import ObjectKey


def payload(key: ObjectKey, nbytes: int) -> bytes:
    """Random-looking bytes seeded by the key: unique per key, reproducible by any process."""
    return random.Random(key.to_bytes()).randbytes(nbytes)


def figures(scenario: str, **values: Any) -> None:
    """Print a scenario's figures on one line (``pytest -s`` shows it)."""
    body = "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())
    print(f"\nFIGURES {scenario}: {body}", flush=True)


def peak_rss_mib(pid: int) -> float:
    """Peak resident set size of a live process (Linux ``VmHWM``), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc status")


def unlink_arena(name: str) -> None:
    """Remove a killed server's arena from /dev/shm (kill -9 skips its cleanup)."""
    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        pass


SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>tc-test</RequestId></Error>"
)


class FaultyS3Proxy:
    """A tiny HTTP proxy in front of an S3 endpoint whose behaviour a test switches at run time.

    ``mode``: ``"ok"`` forwards; ``"slowdown"`` answers ``503 SlowDown`` (S3's throttling reply);
    ``"error"`` answers ``500 InternalError``; ``"slow"`` waits ``delay_s`` before forwarding (a
    brown-out); ``"down"`` closes every connection without answering. Real HTTP; boto3 is not patched.
    """

    def __init__(self, target_url: str) -> None:
        host, port = target_url.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.mode = "ok"
        self.delay_s = 0.0
        self.faults = 0  # requests answered with a fault; guarded by _lock
        self.forwarded = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                mode = proxy.mode
                if mode != "ok" and mode != "slow":
                    with proxy._lock:
                        proxy.faults += 1
                    if mode == "down":
                        self.close_connection = True
                        self.connection.shutdown(2)
                        return
                    status, code = (503, b"SlowDown") if mode == "slowdown" else (500, b"InternalError")
                    reply = SLOW_DOWN if mode == "slowdown" else SLOW_DOWN.replace(b"SlowDown", code)
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(reply)
                    return
                if mode == "slow":
                    with proxy._lock:
                        proxy.faults += 1
                    time.sleep(proxy.delay_s)
                conn = http.client.HTTPConnection(*proxy.target, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()
                with proxy._lock:
                    proxy.forwarded += 1

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:  # a cut connection
                pass

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, name="test-faulty-s3", daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
