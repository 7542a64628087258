"""The soak tests' clients and readings: traffic that keeps its connections open between
phases (so what a long-lived connection keeps is measured with it), churn (connections opened
and closed, streams reset by the client, tenants and prompt prefixes seen once), and the
gateway's heap report (`GET /admin/debug/heap`).

A phase sends a fixed number of requests per lane and ends with the gateway idle: the report is
read with nothing in flight, so two readings differ by what the traffic left behind, not by what
was in flight at that moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import httpx

from gateway.proto import load

CHAT = "/v1/chat/completions"
INFER = "/sluice.inference.v1.Inference/Infer"


def chat_body(
    prompt: str = "Say hello to the gateway in five words.", stream: bool = False
) -> bytes:
    return json.dumps(
        {
            "model": "llama-3-8b",
            "max_tokens": 4,
            "stream": stream,
            "messages": [{"role": "user", "content": prompt}],
        }
    ).encode()


def heap(admin_port: int) -> dict[str, Any]:
    """The gateway's heap report (it collects garbage first)."""
    url = f"http://127.0.0.1:{admin_port}/admin/debug/heap?top=200"
    with urllib.request.urlopen(url, timeout=30) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


def growth(a: dict[str, Any], b: dict[str, Any], most: int = 12) -> str:
    """What grew between two reports: blocks, RSS and the object types that grew most."""
    types = {k: v - a["types"].get(k, 0) for k, v in b["types"].items()}
    grew = sorted(((v, k) for k, v in types.items() if v > 0), reverse=True)[:most]
    return (
        f"blocks {a['allocated_blocks']} -> {b['allocated_blocks']} "
        f"({b['allocated_blocks'] - a['allocated_blocks']:+d}), "
        f"rss {a['rss_bytes'] / 1e6:.1f} -> {b['rss_bytes'] / 1e6:.1f} MB, "
        f"gc objects {a['gc_objects']} -> {b['gc_objects']}, grew: {grew}"
    )


async def spread(n: int, concurrency: int, one: Callable[[int], Awaitable[None]]) -> None:
    """Call `one(i)` for i in 0..n-1, `concurrency` at a time."""
    it = iter(range(n))

    async def worker() -> None:
        for i in it:
            await one(i)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


@dataclass
class Tally:
    """Answers per lane: how many, and what went wrong (the first few)."""

    ok: int = 0
    bad: list[str] = field(default_factory=list)

    def check(self, good: bool, what: str) -> None:
        if good:
            self.ok += 1
        elif len(self.bad) < 5:
            self.bad.append(what)


class Steady:
    """Long-lived connections: HTTP/1.1 keep-alive, one h2c connection with many streams (where
    the HTTP engine serves HTTP/2: `h2c`), one gRPC channel with many calls; each kept open from
    the first phase to the last."""

    def __init__(self, http_port: int, grpc_port: int, h2c: bool, concurrency: int = 8) -> None:
        self.base = f"http://127.0.0.1:{http_port}"
        self.concurrency = concurrency
        self.h1 = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=concurrency, force_close=False)
        )
        self.h2 = httpx.AsyncClient(
            http1=False, http2=True, limits=httpx.Limits(max_connections=1), timeout=10
        )
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
        pb2, stubs = load()
        self.stub = stubs.InferenceStub(self.channel)
        self.infer = pb2.InferRequest(model="m", prompt="hello", max_tokens=1)
        self.lanes = ("h1", "h2c", "grpc") if h2c else ("h1", "grpc")
        self.tally = {k: Tally() for k in self.lanes}
        self.body = chat_body()

    async def phase(self, n: int) -> None:
        async def h1(_: int) -> None:
            async with self.h1.post(self.base + CHAT, data=self.body) as r:
                data = await r.read()
                self.tally["h1"].check(r.status == 200 and b"usage" in data, f"{r.status}")

        async def h2c(_: int) -> None:
            r = await self.h2.post(self.base + CHAT, content=self.body)
            ok = r.status_code == 200 and r.http_version == "HTTP/2" and b"usage" in r.content
            self.tally["h2c"].check(ok, f"{r.status_code} {r.http_version}")

        async def call(_: int) -> None:
            reply = await self.stub.Infer(self.infer, timeout=10)
            self.tally["grpc"].check(bool(reply.text), repr(reply))

        c = self.concurrency
        lanes = {"h1": h1, "h2c": h2c, "grpc": call}
        await asyncio.gather(*(spread(n, c, lanes[k]) for k in self.lanes))

    async def close(self) -> None:
        await self.h1.close()
        await self.h2.aclose()
        await self.channel.close()


async def h2_resets(port: int, n: int, tally: Tally) -> None:
    """`n` streams on h2c connections, each reset by the client: every other one right after
    its request is sent (the gateway is still reading it or waiting on the backend), the rest
    once the answer's headers arrive. A connection the gateway ends (rapid-reset protection) is
    replaced by a new one."""
    body = chat_body(stream=True)
    done = 0
    while done < n:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        ended = False
        try:
            while done < n and not ended:
                sid = conn.get_next_available_stream_id()
                headers = [
                    (b":method", b"POST"),
                    (b":scheme", b"http"),
                    (b":authority", b"soak"),
                    (b":path", CHAT.encode()),
                    (b"content-type", b"application/json"),
                ]
                conn.send_headers(sid, headers)
                conn.send_data(sid, body, end_stream=True)
                early = done % 2 == 0
                if early:
                    conn.reset_stream(sid)
                writer.write(conn.data_to_send())
                answered = early
                while not answered and not ended:
                    data = await asyncio.wait_for(reader.read(65536), 10)
                    if not data:
                        ended = True
                        break
                    for e in conn.receive_data(data):
                        if isinstance(e, h2.events.ResponseReceived | h2.events.StreamEnded):
                            answered = answered or e.stream_id == sid
                        elif isinstance(e, h2.events.ConnectionTerminated):
                            ended = True
                    if answered and not ended:
                        with contextlib.suppress(h2.exceptions.StreamClosedError):
                            conn.reset_stream(sid)  # unless its answer already ended
                    writer.write(conn.data_to_send())
                done += 1
                tally.check(True, "")
        finally:
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), 5)
            except (OSError, TimeoutError):
                pass


async def churn(
    http_port: int, grpc_port: int, n: int, start: int, tally: dict[str, Tally], h2c: bool
) -> None:
    """`n` requests of each kind that leave nothing to keep: a new HTTP/1.1 connection per
    request; a tenant and a prompt prefix never seen before per request (numbered from `start`);
    a gRPC channel opened and closed per 20 calls; h2c streams reset by the client (`h2c`)."""
    base = f"http://127.0.0.1:{http_port}"

    async def closing(_: int) -> None:
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
            s.post(base + CHAT, data=chat_body()) as r,
        ):
            tally["conn"].check(r.status == 200 and b"usage" in await r.read(), f"{r.status}")

    async with aiohttp.ClientSession() as keep:

        async def once(i: int) -> None:
            k = start + i
            body = chat_body(f"Tenant {k} asks about topic number {k * 7919} in detail.")
            headers = {"x-tenant": f"tenant-{k}", "x-session": f"s-{k}"}
            async with keep.post(base + CHAT, data=body, headers=headers) as r:
                ok = r.status == 200 and b"usage" in await r.read()
                tally["once"].check(ok, f"{r.status}")

        pb2, stubs = load()

        async def channels(_: int) -> None:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
                stub = stubs.InferenceStub(ch)
                for _ in range(20):
                    reply = await stub.Infer(pb2.InferRequest(prompt="x", max_tokens=1), timeout=10)
                    tally["channel"].check(bool(reply.text), repr(reply))

        await asyncio.gather(
            spread(n, 4, closing),
            spread(n, 8, once),
            spread(max(1, n // 20), 2, channels),
            *([h2_resets(http_port, n, tally["reset"])] if h2c else []),
        )


def wait_idle(admin_port: int, timeout: float = 15.0) -> None:
    """Until the gateway has no request in flight (its /readyz says)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/readyz", timeout=5) as r:
            last = json.loads(r.read()).get("in_flight")
        if last == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the gateway still has {last} requests in flight after {timeout}s")
