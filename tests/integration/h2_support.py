"""HTTP/2 test support: a gateway process whose HTTP listener serves h2c (with an auth route),
and a raw HTTP/2 client for attack tests: frames built with hyperframe and hpack over a plain
socket (h2c with prior knowledge), so a test can send what no well-behaved client would."""

from __future__ import annotations

import re
import socket
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h2.connection
import h2.events
from hpack import Encoder
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
)

from tests.integration.conftest import Backend, wait_ready
from tests.support import Proc, free_port, metric_total

SECRET_ENV = "SLUICE_TEST_H2_SECRET"
CHAT = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def policy_text(
    backend: Backend, http: int, admin: int, extra: str = "", timeouts: str = ""
) -> str:
    return f"""\
version: 1
listeners:
  http: {{host: 127.0.0.1, port: {http}, engine: native}}
  grpc: null
  admin: {{host: 127.0.0.1, port: {admin}}}
timeouts: {{first_byte_s: 5, drain_s: 10{timeouts}}}
auth:
  providers:
    - name: internal
      issuer: internal
      audiences: [sluice]
      algorithms: [HS256]
      secret: {{env: {SECRET_ENV}}}
backends:
  - name: sim-http
    protocol: http
    endpoints: [{{address: "127.0.0.1:{backend.http_port}"}}]
routes:
  - name: secure
    match: {{protocol: http, path_prefix: /secure/}}
    backend: sim-http
    auth: required
  - name: openai
    match: {{protocol: http, path_prefix: /}}
    backend: sim-http
{extra}"""


@dataclass
class H2Gateway:
    proc: Proc
    port: int
    admin: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metric(self, name: str, **labels: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/metrics", timeout=5) as r:
            return metric_total(r.read().decode(), name, **labels)

    def rss_kb(self) -> int:
        status = Path(f"/proc/{self.proc.popen.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]


def start_h2_gateway(
    backend: Backend, tmp: Path, extra: str = "", timeouts: str = "", log_level: str = "INFO"
) -> H2Gateway:
    http, admin = free_port(), free_port()
    path = tmp / "policy.yaml"
    path.write_text(policy_text(backend, http, admin, extra, timeouts))
    args = ["serve", "--policy", str(path), "--log-level", log_level]
    proc = Proc(args, tmp / "gateway.log", env={SECRET_ENV: "s" * 32})
    wait_ready(admin, proc)
    return H2Gateway(proc, http, admin)


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
PROTOCOL_ERROR, ENHANCE_YOUR_CALM, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 1, 11, 7, 8, 9


class RawH2:
    """One h2c connection that writes frames as given and reads whatever comes back."""

    def __init__(self, port: int, settings: dict[int, int] | None = None, rcvbuf: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:  # a small receive buffer: the server's writes back up quickly
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(5)
        self.sock.connect(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.enc = Encoder()
        self.port = port
        self.buf = b""
        s = SettingsFrame(0)
        s.settings = settings or {}
        self.send(PREFACE + s.serialize())

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def headers(self, sid: int, method: str = "GET", path: str = "/v1/models", end_stream=True,
                end_headers=True, extra: list[tuple[str, str]] | None = None) -> bytes:  # fmt: skip
        block = self.enc.encode(
            [
                (":method", method),
                (":scheme", "http"),
                (":path", path),
                (":authority", f"127.0.0.1:{self.port}"),
                *(extra or []),
            ]  # fmt: skip
        )
        f = HeadersFrame(sid)
        f.data = block
        flags = set()
        if end_stream:
            flags.add("END_STREAM")
        if end_headers:
            flags.add("END_HEADERS")
        f.flags = flags  # type: ignore[assignment]
        return f.serialize()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def frames(self, timeout: float) -> Iterator[Frame]:
        """Frames the server sends until it closes or `timeout` s pass without any."""
        self.sock.settimeout(timeout)
        while True:
            while len(self.buf) >= 9:
                length = int.from_bytes(self.buf[:3], "big")
                if len(self.buf) < 9 + length:
                    break
                f, n = Frame.parse_frame_header(memoryview(self.buf[:9]))
                f.parse_body(memoryview(self.buf[9 : 9 + n]))
                self.buf = self.buf[9 + n :]
                yield f
            try:
                data = self.sock.recv(65536)
            except (TimeoutError, OSError):
                return
            if not data:
                return
            self.buf += data

    def goaway(self, timeout: float = 3.0) -> GoAwayFrame | None:
        for f in self.frames(timeout):
            if isinstance(f, GoAwayFrame):
                return f
        return None


def frame(f: Frame, **attrs: object) -> bytes:
    for k, v in attrs.items():
        setattr(f, k, v)
    return f.serialize()


def ping(i: int) -> bytes:
    return frame(PingFrame(0), opaque_data=i.to_bytes(8, "big"))


def settings() -> bytes:
    return SettingsFrame(0).serialize()


def empty_data(sid: int) -> bytes:
    return DataFrame(sid).serialize()


def continuation(sid: int, size: int = 16000) -> bytes:
    return frame(ContinuationFrame(sid), data=b"\x00" * size)


def rst(sid: int, code: int = CANCEL) -> bytes:
    return frame(RstStreamFrame(sid), error_code=code)


def flood_until_closed(conn: RawH2, payload: bytes, seconds: float = 5.0) -> float:
    """Send `payload` again and again without reading; the seconds until the server cut the
    connection (a send fails), or `seconds` when it never did."""
    start = time.monotonic()
    conn.sock.settimeout(0.5)
    while time.monotonic() - start < seconds:
        try:
            conn.sock.send(payload)
        except TimeoutError:
            continue  # the buffers are full: the server stopped reading
        except OSError:
            return time.monotonic() - start
    return seconds


def refused_streams(
    conn: RawH2, wait_s: float = 1.0, expect: int = 0
) -> tuple[set[int], GoAwayFrame | None]:
    """The stream ids the server refused with REFUSED_STREAM within `wait_s` (or as soon as
    `expect` were), and the GOAWAY it sent meanwhile (None: the connection lives on)."""
    refused: set[int] = set()
    goaway = None
    for f in conn.frames(wait_s):
        if isinstance(f, RstStreamFrame) and f.error_code == REFUSED_STREAM:
            refused.add(f.stream_id)
            if expect and len(refused) >= expect:
                break
        elif isinstance(f, GoAwayFrame):
            goaway = f
    return refused, goaway


def exchange(
    sock: socket.socket,
    conn: h2.connection.H2Connection,
    sid: int,
    head: list[tuple[str, str]],
    body: bytes,
) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """One request on a client `conn` (h2) over `sock`: `head` and `body` on stream `sid`, then
    the events read until the stream ends. Returns its response headers and trailers."""
    conn.send_headers(sid, head)
    conn.send_data(sid, body, end_stream=True)
    sock.sendall(conn.data_to_send())
    headers: dict[Any, Any] = {}
    trailers: dict[Any, Any] = {}
    ended = False
    while not ended:
        data = sock.recv(65536)
        assert data, "connection closed"
        for e in conn.receive_data(data):
            if isinstance(e, h2.events.ResponseReceived):
                headers = dict(e.headers)
            elif isinstance(e, h2.events.TrailersReceived):
                trailers = dict(e.headers)
            elif isinstance(e, h2.events.DataReceived):
                conn.acknowledge_received_data(e.flow_controlled_length, e.stream_id)
            elif isinstance(e, h2.events.StreamEnded) and e.stream_id == sid:
                ended = True
        sock.sendall(conn.data_to_send())
    return headers, trailers
