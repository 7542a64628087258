"""What the model-server-figures test and benchmark share: simulated members with a fixed number
of generation slots, gateway replicas in front of them (power-of-two choices on their own
counts, or `load.metrics`), an outside client that keeps one member busy without going through
Sluice, and the figures: each member's share of the gateways' requests and the gateways'
clients' time to first token."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx

from tests.integration.admission_support import TenantRun, client, start_backend
from tests.integration.conftest import Backend, Gateway, wait_ready
from tests.support import Proc, free_port

METRICS = "\n    load: {{metrics: {{preset: vllm, interval_ms: 50{}}}}}"


def start_members(tmp: Path, n: int, slots: int, token_ms: float = 10) -> list[Backend]:
    return [start_backend(tmp / f"m{i}", slots=slots, ttft_ms=20, token_ms=token_ms)
            for i in range(n)]  # fmt: skip


def start_gateway(members: list[Backend], tmp: Path, metrics: bool,
                  max_in_flight: int | None = None, admission: bool = False,
                  names: str = "") -> Gateway:  # fmt: skip
    """A gateway before `members` (backend `sim`); `metrics`: with `load.metrics` (`names`: its
    `names:` flow mapping)."""
    eps = ", ".join(f'{{address: "127.0.0.1:{m.http_port}"}}' for m in members)
    limit = f"\n    max_in_flight: {max_in_flight}" if max_in_flight else ""
    load = METRICS.format(f", names: {names}" if names else "") if metrics else ""
    tail = "admission: {queue: {max_wait_ms: 10000, max_queued: 1000}}" if admission else ""
    return gateway_for(tmp, f"endpoints: [{eps}]{limit}{load}", tail)


def gateway_for(tmp: Path, backend: str, tail: str = "") -> Gateway:
    """A gateway whose route `openai` (/v1/) goes to backend `sim`, described by `backend` (its
    fields, indented by 4 after the first line), then `tail` (more policy sections)."""
    http, admin = free_port(), free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "policy.yaml"
    path.write_text(f"""\
version: 1
listeners: {{http: {{host: 127.0.0.1, port: {http}}}, admin: {{host: 127.0.0.1, port: {admin}}}}}
backends:
  - name: sim
    {backend}
routes:
  - name: openai
    match: {{protocol: http, path_prefix: /v1/}}
    backend: sim
{tail}
""")
    proc = Proc(["serve", "--policy", str(path)], tmp / "gateway.log")
    wait_ready(admin, proc)
    return Gateway(proc, path, http, 0, admin)  # (no gRPC listener)


def state(gw: Gateway) -> Any:
    with urllib.request.urlopen(f"{gw.admin}/admin/state", timeout=5) as r:
        return json.loads(r.read())


def sim_members(gw: Gateway) -> list[Any]:
    """The members of backend `sim` as /admin/state shows them."""
    rows = state(gw)["backends"]["backends"]
    return next(r for r in rows if r["name"] == "sim")["members"]  # type: ignore[no-any-return]


def member_requests(gw: Gateway, members: list[Backend]) -> list[int]:
    """Requests the gateway sent each member (in member order)."""
    got = {m["address"]: m["requests"] + m["in_flight"] for m in sim_members(gw)}
    return [got.get(f"127.0.0.1:{m.http_port}", 0) for m in members]


async def outside(member: Backend, clients: int, tokens: int, until: float) -> TenantRun:
    """Closed-loop clients straight to `member` (not through Sluice)."""
    run = TenantRun("outside")
    url = f"http://127.0.0.1:{member.http_port}/v1/chat/completions"
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as http:
        await asyncio.gather(*(client(http, url, run, tokens, until, delay=0.3 * i / clients)
                               for i in range(clients)))  # fmt: skip
    return run


async def through(gws: list[Gateway], clients: int, tokens: int, until: float,
                  run: TenantRun | None = None) -> TenantRun:  # fmt: skip
    """`clients` closed-loop clients per gateway, their starts spread (recorded in `run`)."""
    run = run if run is not None else TenantRun("clients")
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as http:
        await asyncio.gather(*(
            client(http, f"{gw.http}/v1/chat/completions", run, tokens, until,
                   delay=0.3 * i / clients)
            for gw in gws for i in range(clients)
        ))  # fmt: skip
    return run


async def busy_member_run(gws: list[Gateway], members: list[Backend], seconds: float,
                          clients: int, tokens: int, outside_clients: int,
                          warmup: float = 1.0) -> tuple[TenantRun, list[int]]:  # fmt: skip
    """The outside client keeps member 0 busy (from `warmup` seconds before the gateways'
    clients start, to their end); returns the gateways' clients' run and the requests each
    member got from the gateways during it."""
    t0 = time.monotonic()
    out = asyncio.ensure_future(outside(members[0], outside_clients, tokens * 4,
                                        t0 + warmup + seconds))  # fmt: skip
    await asyncio.sleep(warmup)
    before = [member_requests(gw, members) for gw in gws]
    run = await through(gws, clients, tokens, time.monotonic() + seconds)
    after = [member_requests(gw, members) for gw in gws]
    await out
    sent = [sum(a[i] - b[i] for a, b in zip(after, before, strict=True))
            for i in range(len(members))]  # fmt: skip
    return run, sent
