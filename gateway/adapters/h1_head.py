"""The request head of the native HTTP/1.1 engine as llhttp reports it, checked as it arrives.

`HeadParser` is the head half of `gateway.adapters.h1.H1Conn`: the parser callbacks for the
target and the header fields, the bounds on both (`limits.max_line_bytes`,
`max_header_count`), the singleton fields (`SINGLETONS`) and the framing rules, and the
`Req` a complete head makes. A refusal is raised as `Refused` from the callback; the
connection answers it (`H1Conn.refuse`). What is refused, and why, is listed in the module
docstring of `gateway.adapters.h1`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.adapters.h1_messages import SINGLETONS, Req, absolute

if TYPE_CHECKING:
    import httptools

    from gateway.adapters.h1_server import H1Server

__all__ = ["BAD", "TOO_LARGE", "HeadParser", "Refused"]


class Refused(Exception):
    """Raised from a parser callback: the request is refused with this answer."""

    def __init__(self, status: int, kind: str, text: str) -> None:
        super().__init__(text)
        self.status, self.kind, self.text = status, kind, text


TOO_LARGE = (431, "headers_too_large", "request header fields too large")
BAD = (400, "bad_request", "malformed HTTP request")


class HeadParser:
    """The state of the head being parsed and the callbacks that fill and check it."""

    server: H1Server  # one declaration for the subclass too (mypyc: no narrowing)
    parser: httptools.HttpRequestParser

    def __init__(self) -> None:
        self.refused: Refused | None = None
        self.in_head = False
        self.head_bytes = 0
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.header_size = 0
        self.host_seen = False
        self.te_seen = False
        self.seen: set[bytes] = set()  # singleton header names seen in this head
        self.body_declared = False  # a non-zero Content-Length or chunked
        self.trailers = 0  # trailer fields of the chunked body being read (dropped)

    def begin_head(self) -> None:
        self.in_head = True
        self.head_bytes = -1  # began inside the chunk being parsed
        self.url = b""
        self.headers = []
        self.header_size = 0
        self.host_seen = self.te_seen = self.body_declared = False
        self.trailers = 0
        self.seen.clear()

    def refusal(self, answer: tuple[int, str, str]) -> Refused:
        """The refusal to raise from a callback, kept in `refused` too: the connection reads it
        there (the parser's error does not chain it when the callback is compiled)."""
        r = self.refused = Refused(*answer)
        return r

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > self.server.limits.max_line_bytes:
            raise self.refusal(TOO_LARGE)

    def on_header(self, name: bytes, value: bytes) -> None:
        limits = self.server.limits
        if not self.in_head:  # a trailer of a chunked body: dropped, never a request header
            self.trailers += 1
            if self.trailers > limits.max_header_count:
                raise self.refusal(TOO_LARGE)
            return
        size = len(name) + len(value)
        if size + 2 > limits.max_line_bytes:
            raise self.refusal(TOO_LARGE)
        if len(self.headers) >= limits.max_header_count:
            raise self.refusal(TOO_LARGE)
        # llhttp drops the whitespace before a value, not after (RFC 9110 §5.5: neither is part
        # of the value).
        stripped = value.rstrip(b" \t")
        if stripped is not value:  # (rstrip returns the value itself when nothing goes)
            value = stripped
            size = len(name) + len(value)
        ln = name.lower()
        if ln in SINGLETONS:
            if ln in self.seen:
                raise self.refusal(BAD)
            self.seen.add(ln)
            if ln == b"host":
                self.host_seen = True
            elif ln == b"transfer-encoding":
                if value.lower() != b"chunked":
                    raise self.refusal(BAD)
                self.te_seen = self.body_declared = True
            elif ln == b"content-length" and value.lstrip(b"0"):
                self.body_declared = True
        self.header_size += size + 4
        self.headers.append((name, value))

    def parsed_head(self) -> Req:
        """The request of the complete head (raises Refused)."""
        parser = self.parser
        method = parser.get_method().decode("ascii")
        http10 = parser.get_http_version() == "1.0"
        url = self.url
        if (
            method == "CONNECT"
            or (not self.host_seen and not http10)  # RFC 9112 §3.2: 400 without Host
            or (self.te_seen and http10)  # RFC 9112 §6.1: faulty framing
            or (url[:1] != b"/" and not (url == b"*" and method == "OPTIONS") and not absolute(url))
            # llhttp would take its body for the upgraded protocol; nothing is upgraded here
            or (self.body_declared and parser.should_upgrade())
        ):
            raise self.refusal(BAD)
        req = Req(method, url, self.headers, self.header_size, parser.should_keep_alive())
        req.http10 = http10
        req.chunked = self.te_seen
        return req
