"""A real HTTP server the tests control, serving a JWKS (or whatever fault a test asks for).

Runs in a thread of the test process (stdlib `ThreadingHTTPServer` on a free port), so a gateway
process or an in-process cache fetches over a real socket. It counts requests per path, which is
how the tests assert "no outbound fetch" (`jku`/`x5u`) and "at most one fetch per cooldown".
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.support import free_port

PATH = "/jwks.json"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: JwksServer


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        o = self.server.owner
        with o.lock:
            o.hits[self.path.split("?")[0]] += 1
            status, ctype, body, drip, delay = o.status, o.ctype, o.body, o.drip_s, o.delay_s
        if delay:
            time.sleep(delay)
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if drip:
                for i in range(len(body)):
                    self.wfile.write(body[i : i + 1])
                    self.wfile.flush()
                    time.sleep(drip)
            else:
                self.wfile.write(body)
        except OSError:
            pass  # the client gave up (a timeout under test)


class JwksServer:
    def __init__(self, port: int = 0) -> None:
        self.port = port or free_port()
        self.lock = threading.Lock()
        self.hits: Counter[str] = Counter()
        self.status = 200
        self.ctype = "application/json"
        self.body = b'{"keys": []}'
        self.drip_s = 0.0
        self.delay_s = 0.0
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{PATH}"

    def serve(
        self,
        doc: Any = None,
        *,
        body: bytes | None = None,
        status: int = 200,
        ctype: str = "application/json",
        drip_s: float = 0.0,
        delay_s: float = 0.0,
    ) -> None:
        with self.lock:
            self.body = body if body is not None else json.dumps(doc).encode()
            self.status, self.ctype, self.drip_s, self.delay_s = status, ctype, drip_s, delay_s

    def count(self, path: str = PATH) -> int:
        with self.lock:
            return self.hits[path]

    def total(self) -> int:
        with self.lock:
            return sum(self.hits.values())

    def up(self) -> None:
        httpd = _Server(("127.0.0.1", self.port), _Handler)
        httpd.owner = self
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def down(self) -> None:
        """Stop listening: fetches get connection refused until `up()`."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def close(self) -> None:
        self.down()
