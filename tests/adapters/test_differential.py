"""Differential fuzz of the two HTTP ingress engines: the same raw bytes, the same outcome.

Each example (`tests.adapters.h1_grammar.stream`: 1-3 pipelined requests, smuggling cases
included, written in 1-3 pieces) is followed by a sentinel request that asks to close, and sent
on a fresh connection to the aiohttp engine and to the native engine, both in this process, each
in front of its own recording upstream. What each engine did is reduced to an `Outcome`:

- `forwarded`: what its upstream received, per request in order: method, target, body, and the
  headers normalised as follows: names lower-cased; grouped by name with the values of one name
  in the order received (the order between different names is ignored); `host` left out (set to
  each engine's own upstream address), and `content-length` / `transfer-encoding` left out (the
  pool frames the body itself; the body bytes are compared instead).
- `answers`: the client's responses in order, 1xx interim responses dropped (a server may omit
  `100 Continue` when the body is already there), each as its status, plus the JSON error `type`
  for 4xx/5xx; a response cut short is `cut`.
- how the connection ended: `eof` (the gateway closed it) or `timeout`.

Both engines must give the same `Outcome`. Run size: `SLUICE_FUZZ_EXAMPLES` (default 2500,
derandomized, so CI sees the same inputs every run; `SLUICE_FUZZ_SEED=N` for a random run).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httptools
import pytest
from hypothesis import HealthCheck, given, seed, settings

from gateway.adapters.aiohttp import HttpListener
from gateway.adapters.engines import start_http
from gateway.adapters.native import NativeListener
from gateway.app import Gateway
from tests.adapters.h1_grammar import stream
from tests.adapters.test_http import POLICY
from tests.support import free_port

SENTINEL = b"GET /api/__end HTTP/1.1\r\nHost: s\r\nConnection: close\r\n\r\n"
READ_TIMEOUT_S = 2.0
UPSTREAM_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\n"
FRAMING = frozenset({"host", "content-length", "transfer-encoding"})
GENERATED_ID = re.compile("[0-9a-f]{32}")  # the request_id filter's own ids
PAUSE_S = 0.005  # between separate writes: the gateway reads each on its own

EXAMPLES = int(os.environ.get("SLUICE_FUZZ_EXAMPLES", "2500"))
SEED = os.environ.get("SLUICE_FUZZ_SEED")

Forwarded = tuple[str, str, tuple[tuple[str, tuple[str, ...]], ...], bytes]


class _Recorder(asyncio.Protocol):
    """One upstream connection: parses requests (httptools), records them, answers 200 "ok"."""

    def __init__(self, seen: list[Forwarded], open_: set[asyncio.Transport]) -> None:
        self.seen = seen
        self.open = open_  # closed at teardown (Server.close leaves accepted connections)
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.open.add(self.transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.open.discard(self.transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # the gateway forwarded CONNECT or an upgrade
            self.seen.append(("UPGRADE", self.url.decode("latin-1"), (), b""))
            assert self.transport is not None
            self.transport.close()
        except httptools.HttpParserError:  # the gateway sent something malformed: a bug
            self.seen.append(("MALFORMED", repr(data[:200]), (), b""))
            assert self.transport is not None
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url, self.headers, self.body = b"", [], b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        groups: dict[str, list[str]] = {}
        for n, v in self.headers:
            if n not in FRAMING:
                if n == "x-request-id" and GENERATED_ID.fullmatch(v):
                    v = "<generated>"
                groups.setdefault(n, []).append(v)
        norm = tuple(sorted((n, tuple(vs)) for n, vs in groups.items()))
        method = self.parser.get_method().decode()
        self.seen.append((method, self.url.decode("latin-1"), norm, self.body))
        assert self.transport is not None
        self.transport.write(UPSTREAM_ANSWER + (b"" if method == "HEAD" else b"ok"))


def _dechunk(raw: bytes, i: int) -> tuple[bytes, int] | None:
    body = b""
    while True:
        eol = raw.find(b"\r\n", i)
        if eol < 0:
            return None
        size = int(raw[i:eol].split(b";")[0], 16)
        i = eol + 2
        if size == 0:
            end = raw.find(b"\r\n\r\n", i - 2)
            return (body, end + 4) if end >= 0 else None
        body += raw[i : i + size]
        i += size + 2


def answers(raw: bytes, closing: list[bool] | None = None) -> list[str]:
    """The responses in `raw`, each as its status (plus the JSON error type for 4xx/5xx, and
    "no body" when a Content-Length body is absent: a HEAD answer); 1xx dropped; "cut" last when
    the stream ends inside a response. `closing` gets, per complete response, whether it closes
    the connection (`Connection: close`, or HTTP/1.0 without `keep-alive`)."""
    out: list[str] = []
    i = 0
    while i < len(raw):
        end = raw.find(b"\r\n\r\n", i)
        if end < 0:
            out.append("cut")
            break
        lines = raw[i:end].split(b"\r\n")
        i = end + 4
        status = int(lines[0].split(b" ", 2)[1])
        fields = dict(ln.lower().split(b": ", 1) for ln in lines[1:])
        body = b""
        label = str(status)
        if status < 200 or status in (204, 304):
            pass
        elif fields.get(b"transfer-encoding") == b"chunked":
            got = _dechunk(raw, i)
            if got is None:
                out.append(label + " cut")
                break
            body, i = got
        elif b"content-length" in fields:
            n = int(fields[b"content-length"])
            if n and (i == len(raw) or raw.startswith(b"HTTP/", i)):
                label += " no body"
            else:
                body, i = raw[i : i + n], i + n
                if len(body) < n:
                    out.append(label + " cut")
                    break
        else:
            body, i = raw[i:], len(raw)
        if status < 200:
            continue
        if closing is not None:
            conn = fields.get(b"connection", b"").lower()
            closing.append(
                conn == b"close" or (lines[0][:8] == b"HTTP/1.0" and conn != b"keep-alive")
            )
        if status >= 400:
            try:
                label += " " + json.loads(body)["error"]["type"]
            except (ValueError, KeyError, TypeError):
                label += " (not the JSON error shape)"
        out.append(label)
    return out


@dataclass
class Outcome:
    forwarded: list[Forwarded] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    end: str = "eof"


@dataclass
class Engine:
    name: str
    listener: HttpListener | NativeListener
    seen: list[Forwarded]

    async def run(self, data: bytes, cuts: list[int], pause: bool = False) -> Outcome:
        """Send `data` in pieces ending at `cuts` (and at its end), then the sentinel; with
        `pause`, wait PAUSE_S after each piece so that each is read on its own, and stop
        writing once the gateway has closed."""
        self.seen.clear()
        out = Outcome()
        reader, writer = await asyncio.open_connection("127.0.0.1", self.listener.port)
        received = bytearray()

        async def read() -> str:
            """To EOF, or to the end of an answer that says `Connection: close` (as a client
            reads: aiohttp keeps a connection open while it discards an unread body)."""
            try:
                while chunk := await reader.read(65536):
                    received.extend(chunk)
                    closing: list[bool] = []
                    answers(bytes(received), closing)
                    if closing and closing[-1]:
                        return "eof"
            except ConnectionError:
                return "reset"
            return "eof"

        reading = asyncio.ensure_future(read())
        try:
            prev = 0
            for c in [*cuts, len(data), len(data) + len(SENTINEL)]:
                if reading.done():
                    break
                with contextlib.suppress(ConnectionError):
                    writer.write((data + SENTINEL)[prev:c])
                    await writer.drain()
                if pause:
                    await asyncio.sleep(PAUSE_S)
                prev = c
            try:
                out.end = await asyncio.wait_for(asyncio.shield(reading), READ_TIMEOUT_S)
            except TimeoutError:
                out.end = "timeout"
        finally:
            reading.cancel()
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        out.answers = answers(bytes(received))
        out.forwarded = list(self.seen)
        return out


def same(a: Outcome, n: Outcome) -> bool:
    """Equal, except that a connection reset (the gateway closed with input unread, and the
    kernel dropped what it had answered) may have lost the answers after those read: then
    what was read must be a prefix of the other's answers, followed there by a refusal."""
    if a == n:
        return True
    if a.forwarded != n.forwarded or "reset" not in (a.end, n.end):
        return False
    if a.answers == n.answers:  # every answer arrived; only the close differs (aiohttp closes
        return True  # with the rest of the input unread, the kernel then resets)
    short, full = (a, n) if a.end == "reset" else (n, a)
    k = len(short.answers)
    return (
        full.answers[:k] == short.answers and len(full.answers) > k and full.answers[k][:1] == "4"
    )


@contextlib.asynccontextmanager
async def engines(tmp_path: Path) -> AsyncIterator[list[Engine]]:
    loop = asyncio.get_running_loop()
    out: list[Engine] = []
    async with contextlib.AsyncExitStack() as stack:
        for name in ("aiohttp", "native"):
            seen: list[Forwarded] = []
            conns: set[asyncio.Transport] = set()
            server = await loop.create_server(
                lambda s=seen, c=conns: _Recorder(s, c), "127.0.0.1", 0
            )
            stack.push_async_callback(asyncio.sleep, 0.01)  # connection_lost of those closed
            stack.callback(lambda c=conns: [t.close() for t in list(c)])
            stack.push_async_callback(server.wait_closed)
            stack.callback(server.close)
            port = server.sockets[0].getsockname()[1]
            d = tmp_path / name
            d.mkdir()
            p = d / "policy.yaml"
            p.write_text(POLICY.format(port=port, dead=free_port(), filters="[request_id, route]"))
            gw = Gateway(p)
            stack.push_async_callback(gw.aclose)
            listener = await start_http(gw, "127.0.0.1", 0, engine=name)
            stack.push_async_callback(listener.close, 1.0)
            out.append(Engine(name, listener, seen))
        yield out


# aiohttp 3.14's C parser keeps the last trailer field of a chunked body and adds it to the
# headers of the next request on the connection (`cb_on_message_begin` does not reset the pending
# field): a known aiohttp bug; examples with trailers are not compared. The native engine drops
# trailers (`test_h1.py::test_native_drops_trailers`).


def _differential(tmp_path: Path, examples: int) -> dict[str, int]:
    """Run the examples; counts of what happened (examples, forwarded ones, refusals, aiohttp
    re-runs, skipped trailer cases)."""
    stats = dict.fromkeys(("examples", "forwarded", "refused", "reruns", "trailers"), 0)
    loop = asyncio.new_event_loop()
    try:
        cm = engines(tmp_path)
        pair = loop.run_until_complete(cm.__aenter__())

        @settings(
            max_examples=examples,
            deadline=None,
            derandomize=SEED is None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(stream())
        def check(example: tuple[bytes, list[int], list[int], bool]) -> None:
            data, cuts, ends, trailers = example
            aio, native = pair
            n = loop.run_until_complete(native.run(data, cuts))
            stats["examples"] += 1
            stats["forwarded"] += len(n.forwarded) > 1  # more than the sentinel
            stats["refused"] += any(x[:1] == "4" for x in n.answers)
            if trailers:  # aiohttp's trailer bug, above
                stats["trailers"] += 1
                return
            a = loop.run_until_complete(aio.run(data, cuts))
            if not same(a, n):
                # aiohttp's parser raises for a whole read: the requests before a malformed one
                # (or before data after `Connection: close`) in the same read are lost. Compare
                # with aiohttp reading each request on its own instead, and if that differs, with
                # the native engine reading them so too (when a refused body arrives with its
                # head, its request never started; when it arrives later, its request answers).
                bounds = sorted({*cuts, *ends})
                stats["reruns"] += 1
                a = loop.run_until_complete(aio.run(data, bounds, pause=True))
                if not same(a, n):
                    n = loop.run_until_complete(native.run(data, bounds, pause=True))
            assert same(a, n), f"input {data!r} (cuts {cuts}):\naiohttp {a}\nnative  {n}"

        if SEED is not None:
            check = seed(int(SEED))(check)
        check()
    finally:
        with contextlib.suppress(Exception):
            loop.run_until_complete(cm.__aexit__(None, None, None))
        loop.close()
    return stats


@pytest.mark.timeout(300)
def test_engines_agree_on_generated_requests(tmp_path: Path) -> None:
    stats = _differential(tmp_path, EXAMPLES)
    print(f"differential fuzz: {stats}")
    # The grammar must keep exercising both paths, and the skipped cases must stay rare. How
    # many examples get a request forwarded depends on timing too (once the gateway closes,
    # the client writes no more): 449-628 of 2,500 in runs of the same inputs.
    assert stats["examples"] >= EXAMPLES
    assert stats["forwarded"] > EXAMPLES // 10 and stats["refused"] > EXAMPLES // 5
    assert stats["trailers"] < EXAMPLES // 10


# One request each, on one connection, then the sentinel: answers on a kept HTTP/1.1 connection
# (the aiohttp engine writes those itself, `AiohttpExchange.respond`), through aiohttp's response
# (HTTP/1.0, HEAD, a 404 of Sluice's own), and the closing one.
HEAD_CASES = (
    b"GET /api/a HTTP/1.1\r\nHost: s\r\n\r\n",
    b"POST /api/b HTTP/1.1\r\nHost: s\r\nContent-Length: 3\r\n\r\nabc",
    b"GET /nowhere HTTP/1.1\r\nHost: s\r\n\r\n",
    b"HEAD /api/c HTTP/1.1\r\nHost: s\r\n\r\n",
    b"GET /api/d HTTP/1.0\r\nHost: s\r\nConnection: keep-alive\r\n\r\n",
)


def heads(raw: bytes, methods: list[bytes]) -> list[tuple[bytes, tuple[bytes, ...], bytes]]:
    """Each response in `raw` (to requests of `methods`, in order) as its status line, its
    header lines lower-cased and sorted (the Date, the overhead and generated request ids
    masked), and its body."""
    out = []
    i = 0
    for method in methods:
        end = raw.index(b"\r\n\r\n", i)
        status, *lines = raw[i:end].split(b"\r\n")
        i = end + 4
        fields = []
        length = 0
        for line in lines:
            name, _, value = line.lower().partition(b": ")
            if name in (b"date", b"x-sluice-overhead-ms"):
                value = b"<" + name + b">"
            elif name == b"content-length":
                length = int(value)
            fields.append(name + b": " + re.sub(rb"[0-9a-f]{32}", b"<id>", value))
        n = 0 if method == b"HEAD" else length
        out.append((status, tuple(sorted(fields)), raw[i : i + n]))
        i += n
    assert i == len(raw), raw[i:]
    return out


async def test_engines_send_the_same_heads(tmp_path: Path) -> None:
    """Both engines answer the same requests with the same fields, value for value (the order
    of the fields aside), and the same bodies."""
    async with engines(tmp_path) as pair:
        got = {}
        for e in pair:
            reader, writer = await asyncio.open_connection("127.0.0.1", e.listener.port)
            raw = b""
            try:
                for case in HEAD_CASES:  # one at a time: each answered before the next is sent
                    writer.write(case)
                    await writer.drain()
                    raw += await asyncio.wait_for(reader.read(65536), READ_TIMEOUT_S)
                writer.write(SENTINEL)  # asks to close: the rest, to the end of the stream
                raw += await asyncio.wait_for(reader.read(), READ_TIMEOUT_S)
            finally:
                writer.close()
            got[e.name] = raw
        methods = [c.split(b" ", 1)[0] for c in (*HEAD_CASES, SENTINEL)]
        aio, native = heads(got["aiohttp"], methods), heads(got["native"], methods)
        statuses = [h[0][:12] for h in aio]
        assert statuses == [b"HTTP/1.1 200"] * 2 + [b"HTTP/1.1 404"] + [b"HTTP/1.1 200"] * 3
        assert aio == native
