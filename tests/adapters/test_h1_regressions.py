"""One regression test per difference the differential fuzz (`test_differential.py`) found
between the two HTTP engines, over raw sockets, on both engines: each pins the behaviour both
now share."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from tests.adapters.test_differential import engines
from tests.adapters.test_h1 import exchange
from tests.adapters.test_http import gateway, upstream

CLOSE = b"GET /api/end HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"

# name → (request bytes, statuses answered in order, requests the upstream saw)
CASES = {
    # native forwarded a request without Host; aiohttp refused it (RFC 9112 §3.2)
    "http11_without_host": (b"GET /api/x HTTP/1.1\r\n\r\n", [400], 0),
    # native accepted chunked in HTTP/1.0 (RFC 9112 §6.1: faulty framing)
    "chunked_in_http10": (
        b"POST /api/x HTTP/1.0\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nab\r\n0\r\n\r\n",
        [400],
        0,
    ),
    # native forwarded a repeated singleton header; aiohttp refused it
    "duplicate_content_type": (
        b"GET /api/x HTTP/1.1\r\nHost: a\r\nContent-Type: a\r\nContent-Type: b\r\n\r\n",
        [400],
        0,
    ),
    # native took a target that is neither origin-form nor `OPTIONS *` nor absolute-form
    "relative_target": (b"GET api/x HTTP/1.1\r\nHost: a\r\n\r\n", [400], 0),
    "asterisk_not_options": (b"GET * HTTP/1.1\r\nHost: a\r\n\r\n", [400], 0),
    # aiohttp forwarded CONNECT in origin-form (to the upstream, as a tunnel request)
    "connect_origin_form": (b"CONNECT /api/x HTTP/1.1\r\nHost: a\r\n\r\n", [400], 0),
    # aiohttp forwarded the body of `gzip, chunked` de-chunked, without saying it was gzip
    "gzip_chunked": (
        b"POST /api/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
        b"2\r\nab\r\n0\r\n\r\n",
        [400],
        0,
    ),
    # aiohttp took an empty Transfer-Encoding as no body and parsed the chunks as requests
    "empty_transfer_encoding": (
        b"POST /api/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: \r\n\r\n0\r\n\r\n",
        [400],
        0,
    ),
    # native's llhttp would not read an upgrade request's body (nothing is upgraded here)
    "upgrade_with_body": (
        b"POST /api/x HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"
        b"Content-Length: 2\r\n\r\nab",
        [400],
        0,
    ),
    # aiohttp did not answer 417 to an expectation other than 100-continue, and neither
    # engine closed after it (the client may hold its body back)
    "expect_unknown": (
        b"POST /api/x HTTP/1.1\r\nHost: a\r\nExpect: magic\r\nContent-Length: 2\r\n\r\nab" + CLOSE,
        [417],
        0,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
async def test_engines_agree(tmp_path: Path, engine: str, name: str) -> None:
    data, statuses, seen = CASES[name]
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (_, lst, _c):
        answers = await exchange(lst.port, data)
        assert [a[0] for a in answers] == statuses
        assert len(up.seen) == seen


async def pieces(port: int, *parts: bytes) -> list[int]:
    """Statuses answered when `parts` are written with a pause between them (aiohttp loses
    the requests read together with a malformed one: see test_differential)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for p in parts:
        writer.write(p)
        await asyncio.sleep(0.1)
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return [int(m) for m in re.findall(rb"HTTP/1\.[01] (\d{3}) ", raw)]


async def test_pipelined_after_upgrade(tmp_path: Path, engine: str) -> None:
    """native stopped parsing after an (ignored) Upgrade: the pipelined request was lost."""
    up_req = b"GET /api/x HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (_, lst, _c):
        assert await pieces(lst.port, up_req, CLOSE) == [200, 200]
        if engine == "native":  # in one read too (aiohttp drops what follows in that read)
            assert [a[0] for a in await exchange(lst.port, up_req + CLOSE)] == [200, 200]


async def test_trailing_whitespace_is_not_part_of_a_value(tmp_path: Path) -> None:
    """native forwarded `X-A: v \t` with its trailing whitespace (RFC 9110 §5.5); the
    recording upstream of test_differential shows the bytes as sent."""
    data = b"GET /api/x HTTP/1.1\r\nHost: a\r\nX-A: v \t\r\n\r\n"  # the sentinel closes
    async with engines(tmp_path) as pair:
        for e in pair:
            out = await e.run(data, [])
            assert out.answers == ["200", "200"], e.name
            assert dict(out.forwarded[0][2])["x-a"] == ("v",), e.name


@pytest.mark.parametrize(("extra", "status"), [(0, 200), (1, 431)])
async def test_header_line_limit_is_exact(
    tmp_path: Path, engine: str, extra: int, status: int
) -> None:
    """aiohttp checked a header's value alone against its limit (but for the first header): the
    policy's max_line_bytes (2048 here) bounds `name: value`, on both engines."""
    line = b"X-Long: " + b"v" * (2048 - 8 + extra)
    data = b"GET /api/x HTTP/1.1\r\nHost: a\r\n" + line + b"\r\nConnection: close\r\n\r\n"
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (_, lst, _c):
        assert [a[0] for a in await exchange(lst.port, data)] == [status]


async def test_head_error_has_no_body(tmp_path: Path, engine: str) -> None:
    """native sent the JSON error body after a HEAD's 404 (RFC 9110 §9.3.2): the next answer
    was read as that body."""
    data = b"HEAD /nowhere HTTP/1.1\r\nHost: a\r\n\r\n" + CLOSE
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (_, lst, _c):
        reader, writer = await asyncio.open_connection("127.0.0.1", lst.port)
        writer.write(data)
        raw = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        first, _, rest = raw.partition(b"\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 404") and b"content-length: " in first.lower()
        assert rest.startswith(b"HTTP/1.1 200")


async def test_malformed_body_of_a_pipelined_request(tmp_path: Path, engine: str) -> None:
    """native started a queued request whose chunked body had failed to parse and waited for
    that body forever; aiohttp waited too when the body failed after its request had started.
    Both answer 400 and close."""
    bad = b"POST /api/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
    good = b"GET /api/x HTTP/1.1\r\nHost: a\r\n\r\n"
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (_, lst, _c):
        t0 = asyncio.get_running_loop().time()
        assert await pieces(lst.port, good, bad) == [200, 400]
        if engine == "native":
            assert [a[0] for a in await exchange(lst.port, good + bad)] == [200, 400]
        assert asyncio.get_running_loop().time() - t0 < 4  # answered, not timed out
        # the body fails after its request started (a later read)
        reader, writer = await asyncio.open_connection("127.0.0.1", lst.port)
        writer.write(bad[: bad.index(b"zz")])
        await asyncio.sleep(0.2)
        writer.write(b"zz\r\n")
        raw = await asyncio.wait_for(reader.read(), 3)
        writer.close()
        assert raw.startswith(b"HTTP/1.1 400")


async def test_chunk_framing_that_breaks_after_a_chunk_is_not_a_whole_body(
    tmp_path: Path, engine: str
) -> None:
    """aiohttp took the chunks read before a malformed chunk-size line (` 1`) as the whole body
    of a request that followed another on its connection, forwarded it and answered 200; both
    engines answer 400 and forward nothing of it."""
    good = b"GET /api/x HTTP/1.1\r\nHost: a\r\n\r\n"
    head = b"GET /api/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (_, lst, _c):
        rest = b"1\r\nx\r\n 1\r\ny\r\n0\r\n\r\n"  # a chunk, then the bad line, in one read
        assert await pieces(lst.port, good, head, rest) == [200, 400]
        assert len(up.seen) == 1


async def test_refusal_is_not_lost_to_a_reset(tmp_path: Path) -> None:
    """native closed at once after a parser refusal: with more input unread, the kernel reset
    the connection and the client could lose the 400. It lingers now (aiohttp does not)."""
    junk = b"x" * 200_000
    data = b"GET /api/x HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n" + junk
    async with upstream() as up, gateway(tmp_path, up.port, engine="native") as (_, lst, _c):
        for _ in range(5):
            reader, writer = await asyncio.open_connection("127.0.0.1", lst.port)
            writer.write(data)
            raw = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            assert raw.startswith(b"HTTP/1.1 400")


async def test_native_drops_trailers(tmp_path: Path) -> None:
    """native appended a chunked body's trailers to its request's headers (counted against the
    header limits, and forwarded when the request started after they arrived: a pipelined one).
    Trailers are dropped now. (aiohttp adds the last trailer to the next request's headers: a
    known aiohttp bug, see test_differential.)"""
    chunked = (
        b"POST /api/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"b\r\nhello world\r\n0\r\nX-T: 1\r\n\r\n"
    )
    data = b"GET /api/x HTTP/1.1\r\nHost: a\r\n\r\n" + chunked + CLOSE
    async with upstream() as up, gateway(tmp_path, up.port, engine="native") as (_, lst, _c):
        answers = await exchange(lst.port, data)
        assert [a[0] for a in answers] == [200, 200, 200]
        assert json.loads(answers[1][2])["len"] == 11
        assert len(up.seen) == 3 and all("x-t" not in seen for seen in up.seen)
