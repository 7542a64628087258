"""Soak: what a gateway holds stays flat under steady traffic and under churn.

A real gateway (each HTTP engine, gRPC on the h2 engine) in front of the simulated backend,
with the features that keep state per client (rate limits, fair admission and prefix affinity
keyed by a tenant header) on. Each test warms up, reads the heap report with the gateway idle,
sends as many requests again, and reads it again: Python's allocated blocks (every object,
ints and strings included) may not grow by more than a small fraction of the requests sent, so
a leak of one small object (~40 bytes) per request, stream, connection, tenant or reload fails.
The longer soak with RSS readings is a benchmark (tests/bench/soak.py).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway.registry.pool import IDLE_S, SWEEP_S
from tests.integration.backends_support import Sim, start_sims
from tests.integration.conftest import Gateway, http_json, wait_ready
from tests.integration.soak_support import (
    Steady,
    Tally,
    churn,
    growth,
    heap,
    wait_idle,
)
from tests.support import Proc, free_port

pytestmark = pytest.mark.integration

WARM_N = 5000  # requests per lane before the first reading (caches fill, then stay)
STEADY_N = 3000  # requests per lane between the readings (the lanes run at once)
CHURN_N = 1200  # per kind (new connections, new tenants, resets; gRPC channels: N / 20)
RELOADS = 10  # per round
# Growth allowed between two idle readings: blocks per request sent, plus a constant for what a
# reading itself leaves (the report's own objects, a counter that grew a digit). A leak of one
# block per request is 10× the per-request allowance.
PER_REQUEST = 0.1
SLACK = 1500

POLICY = """\
version: 1
listeners:
  http: {{host: 127.0.0.1, port: {http}, engine: {engine}}}
  grpc: {{host: 127.0.0.1, port: {grpc}, engine: h2}}
  admin: {{host: 127.0.0.1, port: {admin}}}
limits:
  http2: {{max_requests_per_connection: 1000000000}}   # one connection for the whole soak
backends:
  - name: sim-http
    protocol: http
    endpoints: [{{address: "127.0.0.1:{a}"}}, {{address: "127.0.0.1:{b}"}}]
    max_in_flight: 64
    breaker: {{consecutive_failures: 50, open_s: 10}}
  - name: sim-grpc
    protocol: grpc
    endpoints: [{{address: "127.0.0.1:{g}"}}]
    unary_methods: [/sluice.inference.v1.Inference/Infer]
routes:
  - name: grpc
    match: {{protocol: grpc}}
    backend: sim-grpc
  - name: openai
    match: {{protocol: http, path_prefix: /}}
    backend: sim-http
    affinity: {{prefix: {{bytes: 64, load_factor: 1.25}}}}
rate_limits:
  max_keys: 300                       # below the tenants each churn round brings
  rules:
    - name: per-tenant
      key: [header:x-tenant]
      qps: 100000
      tokens_per_second: 10000000
admission:
  queue: {{max_wait_ms: 5000, max_queued: 2000}}
  fairness: {{key: [header:x-tenant], max_tenants: 300}}
"""


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Sim]]:
    """Two simulated backends without delays (the soak measures the gateway, fast); the first
    serves gRPC too."""
    tmp = tmp_path_factory.mktemp("soak-sims")
    fast = ("--ttft-ms", "0", "--token-delay-ms", "0")
    started = start_sims(tmp, 1, *fast, grpc=True) + start_sims(tmp, 1, *fast)
    try:
        yield started
    finally:
        for s in started:
            s.proc.stop()


@dataclass
class Soaked(Gateway):
    engine: str = "native"

    @property
    def h2c(self) -> bool:
        """The native HTTP engine serves h2c too; aiohttp's serves HTTP/1.1 only."""
        return self.engine == "native"


@pytest.fixture(scope="module", params=["native", "aiohttp"])
def soak_gateway(
    request: pytest.FixtureRequest, sims: list[Sim], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Soaked]:
    """A gateway of each HTTP engine, gRPC on the h2 engine; rate limits and fair admission
    keyed by a tenant header, prefix affinity over the two members."""
    tmp = tmp_path_factory.mktemp(f"soak-{request.param}")
    http, grpc_port, admin = free_port(), free_port(), free_port()
    a, b = sims
    assert a.grpc_port is not None
    policy = tmp / "policy.yaml"
    policy.write_text(
        POLICY.format(
            http=http,
            grpc=grpc_port,
            admin=admin,
            engine=request.param,
            a=a.port,
            b=b.port,
            g=a.grpc_port,
        )
    )
    proc = Proc(["serve", "--policy", str(policy)], tmp / "gateway.log")
    wait_ready(admin, proc)
    gw = Soaked(proc, policy, http, grpc_port, admin, request.param)
    try:
        yield gw
    finally:
        assert gw.proc.stop() == 0, gw.proc.output()


def reading(gw: Soaked) -> dict[str, object]:
    wait_idle(gw.admin_port)
    return heap(gw.admin_port)


def assert_flat(a: dict, b: dict, sent: int, what: str) -> None:
    grew = b["allocated_blocks"] - a["allocated_blocks"]
    allowed = PER_REQUEST * sent + SLACK
    print(f"{what}: {sent} requests, {growth(a, b)}", file=sys.stderr)
    assert grew <= allowed, f"{what}: memory grew with the traffic: {growth(a, b)}"


def test_steady_traffic_leaves_nothing_behind(soak_gateway: Soaked) -> None:
    """HTTP/1.1 keep-alive, one h2c connection with many streams, one gRPC channel with many
    calls: after a warm-up, another round of as many requests leaves the heap where it was."""

    async def run() -> tuple[dict, dict, dict[str, Tally]]:
        load = Steady(soak_gateway.http_port, soak_gateway.grpc_port, soak_gateway.h2c)
        try:
            await load.phase(WARM_N)
            a = await asyncio.to_thread(reading, soak_gateway)
            await load.phase(STEADY_N)
            b = await asyncio.to_thread(reading, soak_gateway)
            return a, b, load.tally
        finally:
            await load.close()

    a, b, tally = asyncio.run(run())
    for lane, t in tally.items():
        assert not t.bad and t.ok == WARM_N + STEADY_N, (lane, t)
    assert_flat(a, b, len(tally) * STEADY_N, f"steady ({', '.join(tally)})")
    runs = [y - x for x, y in zip(a["gc"]["collections"], b["gc"]["collections"], strict=True)]
    print(f"steady: collector runs by generation {runs}", file=sys.stderr)
    # Requests in flight hold their objects: with CPython's default threshold (700) they alone
    # set the young collection off every few dozen requests, freeing nothing.
    assert runs[0] <= len(tally) * STEADY_N / 1000, runs


def test_churn_leaves_nothing_behind(soak_gateway: Soaked) -> None:
    """Connections opened and closed, streams reset by the client, tenants and prompt prefixes
    that appear once, gRPC channels opened and closed: the second round leaves nothing."""
    lanes = ("conn", "once", "channel", *(("reset",) if soak_gateway.h2c else ()))

    async def run() -> tuple[dict, dict, dict[str, Tally]]:
        tally = {k: Tally() for k in lanes}
        await churn(
            soak_gateway.http_port, soak_gateway.grpc_port, CHURN_N, 0, tally, soak_gateway.h2c
        )
        a = await asyncio.to_thread(reading, soak_gateway)
        await churn(
            soak_gateway.http_port,
            soak_gateway.grpc_port,
            CHURN_N,
            CHURN_N,
            tally,
            soak_gateway.h2c,
        )
        b = await asyncio.to_thread(reading, soak_gateway)
        return a, b, tally

    a, b, tally = asyncio.run(run())
    for lane, t in tally.items():
        assert not t.bad and t.ok > 0, (lane, t)
    assert tally["once"].ok == 2 * CHURN_N and tally["conn"].ok == 2 * CHURN_N, tally
    assert_flat(a, b, len(lanes) * CHURN_N, f"churn ({', '.join(lanes)})")


@pytest.mark.parametrize("soak_gateway", ["native"], indirect=True)
def test_policy_reloads_leave_nothing_behind(soak_gateway: Soaked) -> None:
    """Reloads that change parameters (a limit's rate, the admission queue, a backend's
    breaker) with traffic between them: once the old policies' state is swept (views unused for
    30 s go), the second round leaves the heap where the first left it. The reload path is the
    same on both engines: the native one runs it."""
    path = Path(soak_gateway.policy)
    original = path.read_text()

    def reload(i: int) -> None:
        text = original.replace("qps: 100000", f"qps: {100000 + i}")
        text = text.replace("max_wait_ms: 5000", f"max_wait_ms: {5000 + i}")
        text = text.replace("consecutive_failures: 50", f"consecutive_failures: {50 + i}")
        path.write_text(text)
        status = http_json(
            f"{soak_gateway.admin}/admin/policy/reload?force=1&rollout=none", "POST", {}
        )
        assert status.get("last_result", status).get("ok", True), status

    def swept() -> dict:
        """A reading once the old policies' state has gone: their backend views are kept for
        `IDLE_S` after their last pick (a request still running on them, a rollout's other
        policy), then forgotten at the next sweep. That time passing is the subject here."""
        time.sleep(IDLE_S + SWEEP_S + 1)
        return reading(soak_gateway)

    async def run() -> tuple[dict, dict]:
        load = Steady(soak_gateway.http_port, soak_gateway.grpc_port, soak_gateway.h2c)
        try:
            for i in range(RELOADS):
                await asyncio.to_thread(reload, i)
                await load.phase(50)
            a = await asyncio.to_thread(swept)
            for i in range(RELOADS, 2 * RELOADS):
                await asyncio.to_thread(reload, i)
                await load.phase(50)
            b = await asyncio.to_thread(swept)
            return a, b
        finally:
            await load.close()
            path.write_text(original)

    a, b = asyncio.run(run())
    # Each reload here makes a new breaker per member, a new limit rule state and new views: a
    # reload whose state stayed would add hundreds of blocks each.
    assert_flat(a, b, 3 * 50 * RELOADS, "reloads")
