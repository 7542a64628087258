"""Malformed and smuggling requests against the real HTTP ingress, over raw sockets: each one is
refused (4xx, connection closed) and nothing reaches the upstream."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.core.request import unsafe_path
from tests.adapters.test_http import gateway, upstream

ATTACKS = {
    "cl_and_te": b"POST /api/x HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "duplicate_cl": b"POST /api/x HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n"
    b"Content-Length: 5\r\n\r\nabcde",
    "xchunked": b"POST /api/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
    "chunked_identity": b"POST /api/x HTTP/1.1\r\nHost: a\r\n"
    b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n",
    "obs_fold": b"GET /api/x HTTP/1.1\r\nHost: a\r\nX-A: b\r\n c\r\n\r\n",
    "bare_lf": b"GET /api/x HTTP/1.1\nHost: a\n\n",
    "cr_in_value": b"GET /api/x HTTP/1.1\r\nHost: a\r\nX: \rxTransfer-Encoding: chunked\r\n\r\n",
    "non_ascii_digits": "POST /api/x HTTP/1.1\r\nHost: a\r\nContent-Length: ١٢\r\n\r\n".encode(),
    "duplicate_host": b"GET /api/x HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    "nul_in_value": b"GET /api/x HTTP/1.1\r\nHost: a\r\nX-A: b\x00c\r\n\r\n",
    "lf_in_chunk_ext": b"POST /api/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"1;a\nb\r\nx\r\n0\r\n\r\n",
    # Well-formed requests with a refused path: the connection may stay open, so they ask to close.
    "dot_segments": b"GET /api/../admin HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    "encoded_slash": b"GET /api/v1%2F..%2Fadmin HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    "long_header_line": b"GET /api/x HTTP/1.1\r\nHost: a\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n",
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
async def test_malformed_request_is_refused_and_not_forwarded(
    tmp_path: Path, name: str, engine: str
) -> None:
    async with upstream() as up, gateway(tmp_path, up.port, engine=engine) as (_, listener, _c):
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        try:
            writer.write(ATTACKS[name])
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 5)  # to EOF: the gateway closes
        finally:
            writer.close()
            await writer.wait_closed()
        status = int(answer.split(b" ", 2)[1])
        assert status in (400, 431), answer[:200]
        assert b'"error"' in answer  # the JSON error shape, not aiohttp's text page
        assert up.seen == []


@pytest.mark.parametrize(
    ("path", "unsafe"),
    [
        ("/v1/chat/completions", False),
        ("/v1/models/llama-3.1-8b", False),
        ("/v1/a.b/c..d/.well-known", False),
        ("/v1/x%20y", False),
        ("/v1/../admin", True),
        ("/v1/./admin", True),
        ("/v1/..", True),
        ("/v1/%2e%2e/admin", True),
        ("/v1%2Fadmin", True),
        ("/v1/x%5cy", True),
        ("/v1/x\\y", True),
        ("/v1/x%00", True),
    ],
)
def test_unsafe_path(path: str, unsafe: bool) -> None:
    assert unsafe_path(path) is unsafe
