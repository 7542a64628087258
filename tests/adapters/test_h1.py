"""HTTP/1.1 wire behaviour over raw sockets, for both engines (pipelining, HTTP/1.0, HEAD, chunked
bodies, Expect), plus what only the native engine promises (100 Continue, 417, no Server)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httptools
import pytest

from tests.adapters.test_http import gateway, upstream


class _Responses:
    """Parses responses off a byte stream (httptools), for assertions."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[tuple[int, dict[str, str], bytes]] = []
        self.headers: dict[str, str] = {}
        self.body = b""

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.done.append((self.parser.get_status_code(), self.headers, self.body))
        self.headers, self.body = {}, b""


async def exchange(
    port: int, data: bytes, head_only: bool = False
) -> list[tuple[int, dict[str, str], bytes]]:
    """Send `data`, read to EOF (the request set asks to close), return the parsed answers."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
        await writer.wait_closed()
    rs = _Responses()
    rs.parser.feed_data(raw)
    return rs.done


async def test_pipelined_requests_answered_in_order(tmp_path: Path, engine: str) -> None:
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (_, lst, _c):
        data = (
            b"GET /api/one HTTP/1.1\r\nHost: a\r\n\r\n"
            b"POST /api/two HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc"
            b"GET /nowhere HTTP/1.1\r\nHost: a\r\n\r\n"
            b"GET /api/four HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
        )
        answers = await exchange(lst.port, data)
        assert [a[0] for a in answers] == [200, 200, 404, 200]
        assert json.loads(answers[0][2])["path"] == "/one"
        assert json.loads(answers[1][2]) == {"path": "/two", "len": 3, "method": "POST"}
        assert json.loads(answers[3][2])["path"] == "/four"


async def test_http10_closes_and_head_has_no_body(tmp_path: Path, engine: str) -> None:
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (_, lst, _c):
        answers = await exchange(lst.port, b"GET /api/x HTTP/1.0\r\n\r\n")
        assert answers[0][0] == 200 and json.loads(answers[0][2])["path"] == "/x"
        reader, writer = await asyncio.open_connection("127.0.0.1", lst.port)
        writer.write(b"HEAD /api/x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        raw = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and body == b""


async def test_chunked_request_body(tmp_path: Path, engine: str) -> None:
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (_, lst, _c):
        data = (
            b"POST /api/c HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
        )
        answers = await exchange(lst.port, data)
        assert json.loads(answers[0][2]) == {"path": "/c", "len": 5, "method": "POST"}


async def test_native_expect_continue_and_headers(tmp_path: Path) -> None:
    async with upstream() as up, gateway(tmp_path, up.port, engine="native") as (_, lst, _c):
        reader, writer = await asyncio.open_connection("127.0.0.1", lst.port)
        writer.write(
            b"POST /api/e HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nExpect: 100-continue\r\n"
            b"Connection: close\r\n\r\n"
        )
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"abc")
        raw = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        rs = _Responses()
        rs.parser.feed_data(raw)
        status, headers, body = rs.done[0]
        assert status == 200 and json.loads(body)["len"] == 3
        assert headers["server"].startswith("Python")  # the upstream's own, passed through
        data = b"GET /api/x HTTP/1.1\r\nHost: a\r\nExpect: magic\r\nConnection: close\r\n\r\n"
        answers = await exchange(lst.port, data)
        assert answers[0][0] == 417
        assert "server" not in answers[0][1] and "date" in answers[0][1]  # no version leaks
        assert up.seen[-1].get("expect") is None  # Expect is hop-by-hop


@pytest.mark.parametrize(
    "data",
    [
        b"GET /api/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        b"CONNECT a:443 HTTP/1.1\r\nHost: a:443\r\n\r\n",
        b"GET /api/x HTTP/1.1\r\nHost: a\r\n\r\nGARBAGE\r\n\r\n",
    ],
)
async def test_native_refusals(tmp_path: Path, data: bytes) -> None:
    async with upstream() as up, gateway(tmp_path, up.port, engine="native") as (_, lst, _c):
        answers = await exchange(lst.port, data)
        assert answers[-1][0] == 400
        assert json.loads(answers[-1][2])["error"]["type"] == "bad_request"
        assert len(up.seen) == len(answers) - 1  # only the well-formed request before it


async def test_native_keepalive_timeout(tmp_path: Path) -> None:
    async with upstream() as up, gateway(tmp_path, up.port, engine="native") as (_, lst, _c):
        lst._h1.keepalive_s = 0.3  # type: ignore[union-attr]
        reader, writer = await asyncio.open_connection("127.0.0.1", lst.port)
        writer.write(b"GET /api/x HTTP/1.1\r\nHost: a\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
        assert head.startswith(b"HTTP/1.1 200 ") and b"connection: close" not in head.lower()
        t0 = asyncio.get_running_loop().time()
        rest = await asyncio.wait_for(reader.read(), 2)  # the body, then EOF when idle too long
        assert rest.startswith(b"{")
        assert 0.2 < asyncio.get_running_loop().time() - t0 < 1.5
        writer.close()


async def test_answers_batched_per_loop_turn_reach_their_own_connections(
    tmp_path: Path, engine: str
) -> None:
    """Small answers of one loop turn go out together (native: `OutBatch`): many keep-alive
    connections at once each get their own answers, in order, and a closing answer still
    arrives whole before the close."""
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (_, lst, _c):

        async def client(i: int) -> list[str]:
            reqs = b"".join(
                b"GET /api/c%d-r%d HTTP/1.1\r\nHost: a\r\n\r\n" % (i, j) for j in range(4)
            )
            last = b"GET /api/c%d-end HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n" % i
            answers = await exchange(lst.port, reqs + last)
            return [json.loads(a[2])["path"] for a in answers]

        got = await asyncio.gather(*(client(i) for i in range(24)))
        for i, paths in enumerate(got):
            assert paths == [f"/c{i}-r{j}" for j in range(4)] + [f"/c{i}-end"]
