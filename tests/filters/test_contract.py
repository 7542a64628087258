"""The filter contract: the chain split per phase (plain and coroutine hooks), unwinding, and
state kept in the services across reloads under live traffic."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Final

import aiohttp
import pytest

import gateway.filters.registry as registry
from gateway.adapters.engines import start_http
from gateway.app import Gateway
from gateway.context import EventKind, RequestContext, Status, StreamEvent
from gateway.core.body import opaque
from gateway.filters.chain import Chain
from gateway.services import ServiceKey, Services
from tests.filters.test_chain import ctx_for


class Plain:
    name = "plain"

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def on_request(self, ctx: RequestContext) -> Status:
        self.log.append("plain.req")
        return Status.CONTINUE

    def on_event(self, ctx: RequestContext, event: StreamEvent) -> Status:
        self.log.append(f"plain.event.{event.kind.value}")
        return Status.CONTINUE


class Awaiting:
    name = "awaiting"

    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def on_request(self, ctx: RequestContext) -> Status:
        await asyncio.sleep(0)
        self.log.append("awaiting.req")
        return Status.CONTINUE

    def on_body(self, ctx: RequestContext, body: Any) -> Status:
        self.log.append("awaiting.body")
        return Status.STOP

    async def on_response(self, ctx: RequestContext) -> None:
        self.log.append("awaiting.resp")


class RespOnly:
    name = "resp"

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def on_response(self, ctx: RequestContext) -> None:
        self.log.append("resp.resp")


async def test_chain_is_split_per_phase() -> None:
    log: list[str] = []
    chain = Chain([Plain(log), Awaiting(log), RespOnly(log)])
    assert chain.has_body and chain.has_events
    ctx = ctx_for("/v1/x")
    assert await chain.on_request(ctx) is Status.CONTINUE
    assert chain.on_body(ctx, opaque(3)) is Status.STOP
    assert chain.on_event(ctx, StreamEvent(EventKind.HEAD, 200)) is Status.CONTINUE
    await chain.on_response(ctx)
    assert log == [
        "plain.req",
        "awaiting.req",
        "awaiting.body",
        "plain.event.head",
        "resp.resp",
        "awaiting.resp",
    ]


async def test_on_response_unwinds_only_filters_reached() -> None:
    log: list[str] = []

    class Stopper:
        name = "stop"

        def on_request(self, ctx: RequestContext) -> Status:
            return Status.STOP

    chain = Chain([RespOnly(log), Stopper(), Awaiting(log)])
    ctx = ctx_for("/v1/x")
    assert await chain.on_request(ctx) is Status.STOP
    await chain.on_response(ctx)
    assert log == ["resp.resp"]  # the filter after the stop never ran: no on_response


def test_chain_without_hooks_has_no_phases() -> None:
    chain = Chain([RespOnly([])])
    assert not chain.has_body and not chain.has_events


class Counter:
    """A long-lived owner in the services: what a bucket or breaker table would be."""

    def __init__(self) -> None:
        self.seen = 0
        self.closed = False

    def close(self) -> None:
        self.closed = True


COUNTER: Final = ServiceKey[Counter]("counter")


class Counting:
    name = "request_id"

    def __init__(self, counter: Counter) -> None:
        self.counter = counter

    def on_request(self, ctx: RequestContext) -> Status:
        self.counter.seen += 1
        return Status.CONTINUE


def build_counting(section: Any, services: Services) -> Counting:
    return Counting(services.get(COUNTER, Counter))


POLICY = """
version: 1
listeners: {{http: null, grpc: null, admin: null}}
access_log: {{enabled: false}}
timeouts: {{connect_s: {connect}}}
backends:
  - name: up
    endpoints: [{{address: "127.0.0.1:{port}"}}]
routes:
  - name: all
    backend: up
"""


async def test_reload_under_traffic_keeps_service_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(
        registry.FILTERS,
        "request_id",
        registry.FilterSpec("tests.filters.test_contract:build_counting", lambda c: None),
    )
    from tests.forward.test_phases import upstream

    async with upstream() as up:
        path = tmp_path / "policy.yaml"
        path.write_text(POLICY.format(port=up.port, connect=1))
        gw = Gateway(path)
        listener = await start_http(gw, "127.0.0.1", 0, engine="native")
        counter = gw.services.get(COUNTER, Counter)
        sent = 0
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{listener.port}") as c:

                async def traffic() -> int:
                    n = 0
                    for _ in range(60):
                        async with c.post("/echo", data=b"x") as r:
                            assert r.status == 200
                            await r.read()
                        n += 1
                    return n

                async def reloads() -> list[str]:
                    versions = []
                    for i in range(5):
                        await asyncio.sleep(0.01)
                        path.write_text(POLICY.format(port=up.port, connect=2 + i))
                        result = gw.holder.reload()
                        assert result.ok and result.changed
                        versions.append(result.version)
                    return versions

                counts = await asyncio.gather(traffic(), traffic(), reloads())
                sent = counts[0] + counts[1]
                assert len(set(counts[2])) == 5
            assert gw.services.get(COUNTER, Counter) is counter
            assert counter.seen == sent == 120  # one owner across six chains
        finally:
            await listener.close(1.0)
            await gw.aclose()
        assert counter.closed  # the services close their owners once, at stop
