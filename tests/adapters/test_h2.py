"""The HTTP/2 engine in process (h2c with prior knowledge on the native listener, httpx as the
client): what the lifecycle does for HTTP/1.1 it does per stream, and a refusal or a failure
ends one stream, not the connection."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
from hyperframe.frame import DataFrame

from tests.adapters.test_http import gateway, upstream
from tests.integration.h2_support import RawH2, rst


def h2client(port: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", http1=False, http2=True, timeout=5
    )


async def test_proxy_headers_body_and_query(tmp_path: Path) -> None:
    async with (
        upstream() as up,
        gateway(tmp_path, up.port, engine="native") as (_, lst, _c),
        h2client(lst.port) as c,
    ):
        r = await c.post(
            "/api/v1/chat?x=1",
            content=b"{}",
            headers={"cookie": "a=1", "x-forwarded-for": "10.0.0.1", "x-tenant": "t"},
        )
        assert r.http_version == "HTTP/2" and r.status_code == 200
        assert r.json() == {"path": "/v1/chat?x=1", "len": 2, "method": "POST"}
        assert r.headers["x-up"] == "1" and "x-drop-me" not in r.headers
        assert r.headers["x-request-id"]
        seen = up.seen[-1]
        assert seen["x-tenant"] == "t" and seen["cookie"] == "a=1"
        assert seen["x-forwarded-for"] == "10.0.0.1, 127.0.0.1"
        assert seen["host"] == f"127.0.0.1:{up.port}"


async def test_refusals_end_one_stream_and_the_connection_serves_on(tmp_path: Path) -> None:
    async with (
        upstream() as up,
        gateway(tmp_path, up.port, engine="native") as (_, lst, _c),
        h2client(lst.port) as c,
    ):
        big = await c.post("/api/x", content=b"x" * 5000)  # max_body_bytes 1000
        assert big.status_code == 413
        many = await c.get("/api/x", headers={f"x-h{i}": "v" for i in range(40)})
        assert many.status_code == 431
        assert (await c.get("/nowhere")).status_code == 404
        assert (await c.get("/dead/x")).status_code in (502, 503)
        ok = await c.get("/api/after")
        assert ok.status_code == 200 and ok.json()["path"] == "/after"


async def test_concurrent_streams_and_a_stream_cut_by_its_deadline(tmp_path: Path) -> None:
    async with (
        upstream() as up,
        gateway(tmp_path, up.port, engine="native") as (_, lst, _c),
        h2client(lst.port) as c,
    ):
        rs = await asyncio.gather(*(c.get(f"/api/n{i}") for i in range(20)))
        assert [json.loads(r.content)["path"] for r in rs] == [f"/n{i}" for i in range(20)]
        r = await c.get("/slow")  # first_byte_s 0.3
        assert r.status_code == 504
        assert (await c.get("/api/again")).status_code == 200


async def test_sse_passes_and_a_client_reset_cancels_the_upstream(tmp_path: Path) -> None:
    async with upstream() as up, gateway(tmp_path, up.port, engine="native") as (_, lst, _c):

        def first_event_then_reset() -> bytes:
            conn = RawH2(lst.port)
            try:
                conn.send(conn.headers(1, "GET", "/sse"))
                for f in conn.frames(5.0):
                    if isinstance(f, DataFrame) and f.data:
                        conn.send(rst(1))
                        return bytes(f.data)
                return b""
            finally:
                time.sleep(0.2)
                conn.close()

        assert await asyncio.to_thread(first_event_then_reset) == b"data: 1\n\n"
        await asyncio.wait_for(up.cancelled.wait(), 5)
        async with h2client(lst.port) as c:
            assert (await c.get("/api/still")).status_code == 200
