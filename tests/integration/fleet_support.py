"""What the fleet tests and the fleet benchmark share: gateway processes (each possibly with
`--workers N`) in front of one simulated backend, sharing one private redis-server through the
top-level `store:`, an admission queue and `max_in_flight`; closed-loop streaming clients spread
over them; the backend's peak of requests held at once."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import httpx

from tests.integration.admission_support import TenantRun, client, policy
from tests.integration.conftest import Backend, Gateway, wait_ready
from tests.support import Proc, free_port


def store_section(url: str) -> str:
    return f'store: {{redis: {{url: "{url}", sync_interval_ms: 50, replica_ttl_s: 3}}}}\n'


def start_replica(backend: Backend, tmp: Path, redis_url: str | None, max_in_flight: int = 8,
                  workers: int = 1, section: str = "", tail: str = "") -> Gateway:  # fmt: skip
    http, grpc, admin = free_port(), free_port(), free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "policy.yaml"
    store = store_section(redis_url) if redis_url else ""
    path.write_text(policy(backend, http, grpc, admin, max_in_flight, True, 30000,
                           tail=store + tail, section=section))  # fmt: skip
    proc = Proc(["serve", "--policy", str(path), "--workers", str(workers)], tmp / "gateway.log")
    wait_ready(admin, proc)
    return Gateway(proc, path, http, grpc, admin)


def admin_json(gw: Gateway, path: str, timeout: float = 5) -> Any:
    try:
        with urllib.request.urlopen(f"{gw.admin}{path}", timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # /readyz answers 503 with the same JSON
        with e:
            return json.loads(e.read())


def fleet_mode(gw: Gateway) -> str:
    return str(admin_json(gw, "/readyz", 2)["fleet"]["mode"])


def slots_here(gw: Gateway) -> dict[str, Any]:
    """This replica's (one worker's) view of the pool `sim`."""
    pools = admin_json(gw, "/admin/state")["fleet"]["pools"]
    return next(p for p in pools if p["pool"] == "sim")


def reset_peak(backend: Backend) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{backend.admin_port}/admin/reset",
                                 method="POST", data=b"")  # fmt: skip
    with urllib.request.urlopen(req, timeout=5):
        pass


def peak(backend: Backend) -> int:
    return int(backend.stats()["peak_generating"])


async def load(gws: list[Gateway], clients: int, seconds: float, tokens: int = 32,
               tenant: str = "A") -> TenantRun:  # fmt: skip
    """`clients` closed-loop streaming clients, spread round-robin over `gws`, for `seconds`."""
    run = TenantRun(tenant)
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), limits=limits) as http:
        until = time.monotonic() + seconds
        await asyncio.gather(*(
            client(http, f"{gws[i % len(gws)].http}/v1/chat/completions", run, tokens, until,
                   delay=0.3 * i / clients)
            for i in range(clients)
        ))  # fmt: skip
    return run


async def all_on_one(gw: Gateway, clients: int, seconds: float, slots: int,
                     tokens: int = 32) -> tuple[float, int, TenantRun]:  # fmt: skip
    """Every client on `gw`: how soon it runs `slots` - 1 requests (seconds, how many), and the
    run."""
    from tests.support import wait_until

    task = asyncio.create_task(load([gw], clients, seconds, tokens))
    t0 = time.monotonic()
    held = await asyncio.to_thread(
        wait_until, lambda: slots_here(gw)["in_flight_here"], 5, interval=0.02,
        ok=lambda n: n >= slots - 1,
    )  # fmt: skip
    took = time.monotonic() - t0
    return took, held, await task


def kill(gw: Gateway) -> None:
    """SIGKILL, as a crash: nothing is given back."""
    gw.proc.popen.kill()
    gw.proc.popen.wait(5)
