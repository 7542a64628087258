"""DNS discovery against a real dnsmasq (A, AAAA-less names, SRV): members follow the records,
a failed or empty lookup keeps the last members and says so, SRV records give ports and levels."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.policy.model import Backend
from gateway.registry.dns import DnsWatcher
from gateway.registry.pool import BACKENDS, BackendPool
from gateway.services import Services
from tests.integration.dns_support import DnsServer
from tests.support import until


@pytest.fixture
def dns_server(tmp_path: Path) -> Iterator[DnsServer]:
    srv = ("_http._tcp.vllm.sluice.test,a.sluice.test,8001,10,5",
           "_http._tcp.vllm.sluice.test,b.sluice.test,8002,20,1")  # fmt: skip
    s = DnsServer(tmp_path, srv=srv).start()
    try:
        yield s
    finally:
        s.stop()


def view_of(services: Services, server: DnsServer, **dns: Any) -> Any:
    pool = services.get(BACKENDS, lambda: BackendPool(services))
    cfg = Backend.model_validate({"name": "b", "discovery": {"dns": {
        "port": 8000, "interval_s": 0.3, "timeout_s": 0.5, "resolvers": [server.resolver], **dns,
    }}})  # fmt: skip
    v = pool.view(cfg)
    pool.activate([v], {})
    return v


def addresses(v: Any) -> set[str]:
    v.plan(time.monotonic())  # (the plan brings the members up to date)
    return set(v.members)


async def test_members_follow_the_a_records(dns_server: DnsServer, services: Services) -> None:
    dns_server.hosts({"vllm": ["127.0.0.11"]})
    v = view_of(services, dns_server, name="vllm.sluice.test")
    await until(lambda: addresses(v) == {"127.0.0.11:8000"})
    w = v.watcher
    assert isinstance(w, DnsWatcher) and w.up and not w.kept
    assert all(m.source == "dns" for m in v.members.values())
    dns_server.hosts({"vllm": ["127.0.0.11", "127.0.0.12"]})
    t0 = time.monotonic()
    await until(lambda: addresses(v) == {"127.0.0.11:8000", "127.0.0.12:8000"})
    assert time.monotonic() - t0 < 0.3 + 0.5  # within interval_s (and one lookup)
    dns_server.hosts({"vllm": ["127.0.0.12"]})
    await until(lambda: addresses(v) == {"127.0.0.12:8000"})


async def test_empty_and_failed_lookups_keep_the_members(
    dns_server: DnsServer, services: Services
) -> None:
    dns_server.hosts({"vllm": ["127.0.0.11"]})
    v = view_of(services, dns_server, name="vllm.sluice.test")
    await until(lambda: addresses(v) == {"127.0.0.11:8000"})
    w = v.watcher
    dns_server.hosts({})  # NXDOMAIN: an empty answer
    await until(lambda: w.kept and w.error == "empty answer")
    assert addresses(v) == {"127.0.0.11:8000"} and w.up is False
    assert v.state(time.monotonic())["registry"]["kept"] is True
    dns_server.stop()  # no server at all
    await until(lambda: "Timeout" in w.error or "timed out" in w.error, timeout=5)
    assert addresses(v) == {"127.0.0.11:8000"} and w.kept
    dns_server.start()
    dns_server.hosts({"vllm": ["127.0.0.13"]})
    await until(lambda: addresses(v) == {"127.0.0.13:8000"})
    assert w.up and not w.kept and w.error == ""


async def test_srv_records_give_ports_and_levels(dns_server: DnsServer, services: Services) -> None:
    dns_server.hosts({"a": ["127.0.0.11"], "b": ["127.0.0.12"]})
    v = view_of(services, dns_server, srv="_http._tcp.vllm.sluice.test")
    await until(lambda: addresses(v) == {"127.0.0.11:8001", "127.0.0.12:8002"})
    a, b = v.members["127.0.0.11:8001"], v.members["127.0.0.12:8002"]
    assert (a.weight, a.priority, b.weight, b.priority) == (5.0, 0, 1.0, 1)
