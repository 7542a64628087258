"""DNS discovery through live processes: a real dnsmasq answering from a hosts file the test
rewrites, simulated members on 127.0.0.x (one port for all, as a headless Service's pods), a
gateway with `discovery.dns`, and closed-loop streaming clients through it all along.

- a record added → its member serves within `interval_s`;
- a record removed → its member drains (its requests in flight finish, it gets no new one) with
  0 failed requests;
- the DNS server stopped (3 s here; SLUICE_DNS_OUTAGE_S=30 for the full half-minute) → 0 failed
  requests, the pool unchanged, /admin/state and the metrics say the members are kept;
- a record answering for a dead address → out by the health check, as a static member.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.admission_support import TenantRun
from tests.integration.conftest import Backend, Gateway
from tests.integration.dns_support import DnsServer
from tests.integration.serverload_support import gateway_for, sim_members, through
from tests.support import Proc, free_port, until, wait_for_port

pytestmark = pytest.mark.integration

IPS = ("127.0.0.11", "127.0.0.12")
OUTAGE_S = float(os.environ.get("SLUICE_DNS_OUTAGE_S", "3"))


@pytest.fixture
def dns_server(tmp_path: Path) -> Iterator[DnsServer]:
    s = DnsServer(tmp_path).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def members(tmp_path: Path, port: int) -> Iterator[list[Backend]]:
    out = []
    for ip in IPS:
        admin = free_port()
        proc = Proc(["mock-backend", "--http", f"{ip}:{port}", "--no-grpc", "--admin",
                     f"127.0.0.1:{admin}", "--ttft-ms", "20", "--token-delay-ms", "10"],
                    tmp_path / f"{ip}.log")  # fmt: skip
        wait_for_port(admin)
        out.append(Backend(proc, port, 0, admin))
    try:
        yield out
    finally:
        for m in out:
            m.proc.stop()


def start_gateway(tmp: Path, dns_server: DnsServer, port: int) -> Gateway:
    return gateway_for(
        tmp,
        f"""discovery:
      dns: {{name: vllm.sluice.test, port: {port}, interval_s: 0.5, timeout_s: 0.5,
            resolvers: ["{dns_server.resolver}"]}}
    health: {{interval_s: 0.5, failing_interval_s: 0.2, unhealthy_after: 1, timeout_s: 0.5}}""",
    )


def served(m: Backend) -> int:
    st = m.stats()
    return int(st["requests"].get("POST /v1/chat/completions", 0) + st["in_flight"])


def registry(gw: Gateway) -> Any:
    with urllib.request.urlopen(f"{gw.admin}/admin/backends", timeout=5) as r:
        return json.loads(r.read())["backends"]["sim"]["registry"]


def metric(gw: Gateway, line_start: str) -> float:
    with urllib.request.urlopen(f"{gw.admin}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line_start))


async def test_members_follow_the_records_without_a_failed_request(
    dns_server: DnsServer, members: list[Backend], port: int, tmp_path: Path
) -> None:
    one, two = (f"{ip}:{port}" for ip in IPS)
    dns_server.hosts({"vllm": [IPS[0]]})
    gw = start_gateway(tmp_path, dns_server, port)
    try:
        await until(lambda: [m["address"] for m in sim_members(gw)] == [one])
        run = TenantRun("clients")
        traffic = asyncio.ensure_future(through([gw], 4, 20, time.monotonic() + 600, run))

        # Added: serves within interval_s (0.5 s; and a lookup).
        dns_server.hosts({"vllm": list(IPS)})
        t0 = time.monotonic()
        await until(lambda: {m["address"] for m in sim_members(gw)} == {one, two})
        assert time.monotonic() - t0 < 1.5
        await until(lambda: served(members[1]) > 0)

        # Removed: drains, no new request.
        dns_server.hosts({"vllm": [IPS[1]]})
        await until(lambda: [m["address"] for m in sim_members(gw)] == [two])
        await until(lambda: members[0].stats()["in_flight"] == 0)
        after = served(members[0])
        n = served(members[1])
        await until(lambda: served(members[1]) > n + 8)  # traffic goes on, to member 2 only
        assert served(members[0]) == after

        # The DNS server away for OUTAGE_S: the pool stays, and says so.
        dns_server.stop()
        await until(lambda: registry(gw)["kept"] is True, timeout=5)
        assert registry(gw)["up"] is False and metric(gw, "sluice_registry_up{") == 0.0
        assert metric(gw, 'sluice_dns_lookups_total{backend="sim",result="error"}') >= 1
        gone = time.monotonic()
        n = served(members[1])
        await until(lambda: time.monotonic() - gone >= OUTAGE_S and served(members[1]) > n + 8,
                    timeout=OUTAGE_S + 10)  # fmt: skip
        assert [m["address"] for m in sim_members(gw)] == [two]
        dns_server.start()
        await until(lambda: registry(gw)["up"] is True)

        assert not traffic.done()  # a client that met an error would have ended it
        traffic.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await traffic
        print(f"DNS away {OUTAGE_S:g} s: {run.completed} requests completed, refused {run.refused}")
        assert run.completed > 40 and not run.refused, run.refused
        for m in members:
            assert m.stats()["failed"] == 0
        errors = metric(gw, "sluice_upstream_errors_total")
        assert errors == 0, gw.proc.output()[-3000:]
    finally:
        assert gw.proc.stop() == 0, gw.proc.output()


async def test_a_record_for_a_dead_address_is_out_by_health_check(
    dns_server: DnsServer, members: list[Backend], port: int, tmp_path: Path
) -> None:
    dead = "127.0.0.13"  # nothing listens there
    dns_server.hosts({"vllm": [IPS[0], dead]})
    gw = start_gateway(tmp_path, dns_server, port)
    try:
        await until(lambda: len(sim_members(gw)) == 2)
        m = await until(lambda: next((m for m in sim_members(gw)
                                      if m["address"] == f"{dead}:{port}"
                                      and not m["health"]["healthy"]), None))  # fmt: skip
        assert "Error" in m["health"]["last_error"]
        run = await through([gw], 2, 4, time.monotonic() + 2.0)
        assert run.completed > 5 and not run.refused  # every request on the live member
    finally:
        assert gw.proc.stop() == 0, gw.proc.output()
