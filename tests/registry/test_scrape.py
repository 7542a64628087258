"""Scrapes of the members' model servers (`load.metrics`) against the real simulated backend:
figures reach the pick and the `full` rule, a missing metric is reported, a failed scrape is
counted and ages out without touching health, and the HTTP client keeps its connection."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.mockbackend import Knobs, MockBackendHandle, start_mock_backend
from gateway.policy.model import Backend
from gateway.registry.collector import BackendsCollector
from gateway.registry.pool import BACKENDS, BackendPool
from gateway.services import Services
from tests.support import free_port, until

CHAT = "/v1/chat/completions"


@pytest.fixture
async def backends() -> AsyncIterator[list[MockBackendHandle]]:
    hs = [
        await start_mock_backend("127.0.0.1:0", None, Knobs(ttft_ms=5000, completion_tokens=1))
        for _ in range(2)
    ]
    yield hs
    for h in hs:
        await h.close()


def cfg(ports: list[int], health: bool = True, **metrics: Any) -> Backend:
    return Backend.model_validate({
        "name": "b", "max_in_flight": 2,
        "endpoints": [{"address": f"127.0.0.1:{p}"} for p in ports],
        "health": {"interval_s": 0.2} if health else None,
        "load": {"metrics": {"interval_ms": 50, **metrics}},
    })  # fmt: skip


def one_member(services: Services, b: MockBackendHandle, **metrics: Any) -> tuple[Any, Any]:
    """The view of a live one-member backend scraping `b`, and its member."""
    pool = services.get(BACKENDS, lambda: BackendPool(services))
    assert b.http_port is not None
    v = pool.view(cfg([b.http_port], **metrics))
    pool.activate([v], {})
    (m,) = v.members.values()
    return v, m


async def test_figures_reach_the_member_and_the_pick(
    backends: list[MockBackendHandle], services: Services
) -> None:
    busy, idle = backends
    await busy.update_knobs({"slots": 2})
    pool = services.get(BACKENDS, lambda: BackendPool(services))
    ports = [h.http_port for h in backends]
    v = pool.view(cfg([p for p in ports if p is not None]))
    pool.activate([v], {})
    mb, mi = v.members.values()
    await until(lambda: mb.core.figures is not None and mi.core.figures is not None)
    assert mb.core.server == 0.0 and not mb.core.scrape.full
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession(f"http://127.0.0.1:{busy.http_port}") as http:
        calls = [asyncio.ensure_future(http.post(CHAT, json=body)) for _ in range(5)]
        await until(lambda: mb.core.figures is not None and mb.core.figures.waiting == 3)
        await until(lambda: mb.core.scrape.full)
        # 2 running we did not send + 3 waiting × 2 + a full KV cache × 4
        assert mb.core.server == 12.0 and mi.core.server == 0.0
        picks = [v.take(time.monotonic(), None) for _ in range(200)]
        assert all(p is not None and p[0] is mi for p in picks)
        snap = v.state(time.monotonic())["members"][0]["server"]  # type: ignore[index]
        assert snap["running"] == 2.0 and snap["waiting"] == 3.0 and snap["full"] is True
        assert snap["stale"] is False and snap["scrapes_ok"] >= 1
        fam = next(f for f in BackendsCollector().collect()
                   if f.name == "sluice_backend_member_server")  # fmt: skip
        got = {(x.labels["member"], x.labels["figure"]): x.value for x in fam.samples}
        assert got[(mb.address, "waiting")] == 3.0 and got[(mb.address, "full")] == 1.0
        assert got[(mi.address, "full")] == 0.0
        for c in calls:
            c.cancel()
    await until(lambda: not mb.core.scrape.full and mb.core.server == 0.0)


async def test_a_missing_metric_is_reported_within_an_interval(
    backends: list[MockBackendHandle], services: Services, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "sluice.backends")
    v, m = one_member(services, backends[0], names={"kv_cache": "vllm:gpu_cache_usage_perc"})
    t0 = time.monotonic()
    await until(lambda: m.core.scrape is not None and m.core.scrape.ok >= 1)
    assert time.monotonic() - t0 < 0.5
    snap = v.state(time.monotonic())["members"][0]["server"]  # type: ignore[index]
    assert snap["missing_metrics"] == ["vllm:gpu_cache_usage_perc"] and snap["kv_cache"] is None
    assert "lacks vllm:gpu_cache_usage_perc" in caplog.text


async def test_a_failed_scrape_is_counted_not_a_health_failure(
    backends: list[MockBackendHandle], services: Services
) -> None:
    await backends[0].update_knobs({"waiting": 5})
    v, m = one_member(services, backends[0], port=free_port())  # a port nobody listens on ...
    await until(lambda: m.core.scrape is not None and m.core.scrape.failed >= 3)
    assert m.core.figures is None and m.core.server == 0.0 and not m.core.scrape.full
    await until(lambda: m.health is not None and m.health.checks >= 2)
    assert m.health is not None and m.health.healthy  # ... still healthy
    assert "Error" in v.state(time.monotonic())["members"][0]["server"]["last_error"]  # type: ignore[index]


async def test_figures_age_out_after_three_intervals(
    backends: list[MockBackendHandle], services: Services
) -> None:
    await backends[0].update_knobs({"waiting": 5})
    v, m = one_member(services, backends[0])
    await until(lambda: m.core.server == 10.0 and m.core.scrape.full)
    await backends[0].close()  # the server goes away: the figures stop coming
    t0 = time.monotonic()
    await until(lambda: m.core.server == 0.0 and not m.core.scrape.full)
    assert time.monotonic() - t0 >= 0.1  # kept while fresh (3 × 50 ms since the last read)
    assert m.core.figures is not None and m.core.figures.waiting == 5.0  # last known, shown


async def test_the_scraper_stops_with_its_view(
    backends: list[MockBackendHandle], services: Services
) -> None:
    pool = services.get(BACKENDS, lambda: BackendPool(services))
    ports = [h.http_port for h in backends if h.http_port is not None]
    v = pool.view(cfg(ports))
    pool.activate([v], {})
    await until(lambda: all(m.core.scrape is not None for m in v.members.values()))
    plain = Backend.model_validate(
        {"name": "b", "endpoints": [{"address": f"127.0.0.1:{ports[0]}"}]}
    )
    v2 = pool.view(plain)
    pool.activate([v2], {})  # the sweep stops the old section's scrapes
    assert not pool.scrapers or all(
        not s.targets and s.task is None for s in pool.scrapers.values()
    )
    assert all(m.core.scrape is None and m.core.server == 0.0 for m in v.members.values())


class PageServer:
    """A raw HTTP/1.1 server answering every request with one canned answer; counts its
    connections."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.handlers: set[asyncio.Task[Any]] = set()
        self.readers: list[asyncio.StreamReader] = []

    async def handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        self.readers.append(r)
        try:
            while await r.readuntil(b"\r\n\r\n"):
                w.write(self.answer)
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()

    async def __aenter__(self) -> int:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for r in self.readers:
            r.feed_eof()  # each handler ends on its own (a cancelled one upsets asyncio 3.11)
        await asyncio.gather(*self.handlers, return_exceptions=True)


def page_view(services: Services, port: int, **metrics: Any) -> Any:
    pool = services.get(BACKENDS, lambda: BackendPool(services))
    v = pool.view(cfg([port], health=False, **metrics))  # (a check would open a connection)
    pool.activate([v], {})
    return next(iter(v.members.values()))


async def test_one_connection_and_chunked_pages(services: Services) -> None:
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"5\r\nvllm:\r\n17\r\nnum_requests_running 3\n\r\n0\r\n\r\n")  # fmt: skip
    srv = PageServer(chunked)
    async with srv as port:
        m = page_view(services, port)
        await until(lambda: m.core.scrape is not None and m.core.scrape.ok >= 5)
        assert m.core.figures is not None and m.core.figures.running == 3.0
        assert m.core.scrape.failed == 0 and srv.connections == 1  # kept alive


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000, "over max_bytes"),
        (b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n", "status 404"),
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "not an HTTP/1.1 answer"),
    ],
)
async def test_bad_pages_fail_the_scrape(services: Services, answer: bytes, error: str) -> None:
    async with PageServer(answer) as port:
        m = page_view(services, port, max_bytes=1024)
        await until(lambda: m.core.scrape is not None and m.core.scrape.failed >= 2)
        assert error in m.core.scrape.last_error and m.core.figures is None


async def test_a_silent_server_times_out(services: Services) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)  # accepts (in the kernel backlog), never answers
        m = page_view(services, s.getsockname()[1], timeout_ms=100)
        await until(lambda: m.core.scrape is not None and m.core.scrape.failed >= 1)
        assert "timeout" in m.core.scrape.last_error


async def test_a_changed_section_takes_the_members_over(
    backends: list[MockBackendHandle], services: Services
) -> None:
    pool = services.get(BACKENDS, lambda: BackendPool(services))
    port = backends[0].http_port
    assert port is not None
    await backends[0].update_knobs({"waiting": 1})
    old = pool.view(cfg([port]))
    pool.activate([old], {})
    (m,) = old.members.values()
    await until(lambda: m.core.scrape is not None and m.core.scrape.ok >= 1)
    old.last_pick = time.monotonic()  # still serving requests: its work goes on for IDLE_S
    new = pool.view(cfg([port], weights={"waiting": 5.0}))
    pool.activate([new], {})
    rec = m.core.scrape
    await until(lambda: m.core.server == 5.0 and rec.ok >= 2)  # the new section's weights
    old.last_pick = 0.0
    pool.sweep(time.monotonic())  # the old section's scrapes stop, the new ones keep the member
    assert m.core.scrape is rec and old.scraper.task is None and not old.scraper.targets
    n = rec.ok
    await until(lambda: rec.ok > n and m.core.server == 5.0)


async def test_a_grpc_backend_is_scraped_on_its_metrics_port(services: Services) -> None:
    h = await start_mock_backend("127.0.0.1:0", "127.0.0.1:0", Knobs())
    try:
        await h.update_knobs({"waiting": 2})
        pool = services.get(BACKENDS, lambda: BackendPool(services))
        v = pool.view(Backend.model_validate({
            "name": "g", "protocol": "grpc", "discover_unary": False,
            "endpoints": [{"address": f"127.0.0.1:{h.grpc_port}"}],
            "load": {"metrics": {"interval_ms": 50, "port": h.http_port}},
        }))  # fmt: skip
        pool.activate([v], {})
        (m,) = v.members.values()
        await until(lambda: m.core.figures is not None and m.core.figures.waiting == 2.0)
        assert m.core.server == 4.0
    finally:
        await h.close()
