"""What the admission tests and the fairness benchmark share: a simulated backend with a fixed
number of generation slots, a gateway in front of it (with or without the `admission:` queue),
and closed-loop streaming clients per tenant that record completions, time to first token and
tokens served."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.integration.conftest import Backend, Gateway, wait_ready
from tests.support import Proc, free_port, wait_for_port

ADMISSION = """admission:
  queue: {{max_wait_ms: {max_wait_ms}, max_queued: 2000{anticipate}}}
  fairness:
    key: [header:x-tenant]
    cost: {{input: 1, output: 2}}
    weights: {{from: header:x-weight, default: 1}}
  priority:
    header: x-sluice-priority
    ceiling: {{from: header:x-tier, classes: {{gold: 0, silver: 1, free: 2}}, default: 2}}{reserve}
  deadline: {{header: x-sluice-deadline-ms}}
"""


def start_backend(tmp: Path, slots: int, ttft_ms: float, token_ms: float) -> Backend:
    http, grpc, admin = free_port(), free_port(), free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    proc = Proc(["mock-backend", "--http", f"127.0.0.1:{http}", "--grpc", f"127.0.0.1:{grpc}",
                 "--admin", f"127.0.0.1:{admin}", "--slots", str(slots), "--ttft-ms", str(ttft_ms),
                 "--token-delay-ms", str(token_ms), "--completion-tokens", "1000"],
                tmp / "backend.log")  # fmt: skip
    for port in (http, grpc, admin):
        wait_for_port(port)
    return Backend(proc, http, grpc, admin)


def admission(max_wait_ms: float = 5000, anticipate_ms: float | None = None,
              reserve: float = 0.0) -> str:  # fmt: skip
    """The `admission:` section (optional fields written only when set; `anticipate_ms` None
    leaves the default)."""
    return ADMISSION.format(
        max_wait_ms=max_wait_ms,
        anticipate=f", anticipate_ms: {anticipate_ms:g}" if anticipate_ms is not None else "",
        reserve=f"\n    reserve: {{share: {reserve:g}, rank: gold}}" if reserve else "",
    )


def policy(backend: Backend, http: int, grpc: int, admin: int, max_in_flight: int | None,
           queue: bool, max_wait_ms: float = 5000, tail: str = "",
           section: str = "") -> str:  # fmt: skip
    limit = f"\n    max_in_flight: {max_in_flight}" if max_in_flight else ""
    glimit = f", max_in_flight: {max_in_flight}" if max_in_flight else ""
    return f"""\
version: 1
listeners:
  http: {{host: 127.0.0.1, port: {http}, engine: native}}
  grpc: {{host: 127.0.0.1, port: {grpc}}}
  admin: {{host: 127.0.0.1, port: {admin}}}
timeouts: {{first_byte_s: 30, total_s: 60}}
backends:
  - name: sim
    protocol: http
    endpoints: [{{address: "127.0.0.1:{backend.http_port}"}}]{limit}
  - {{name: sim-grpc, protocol: grpc, unary_methods: [/sluice.inference.v1.Inference/Infer],
     endpoints: [{{address: "127.0.0.1:{backend.grpc_port}"}}]{glimit}}}
routes:
  - name: openai
    match: {{protocol: http, path_prefix: /v1/}}
    backend: sim
  - {{name: grpc, match: {{protocol: grpc}}, backend: sim-grpc}}
access_log: {{enabled: true, headers: [x-tenant]}}
{(section or admission(max_wait_ms)) if queue else ""}{tail}"""


def start(backend: Backend, tmp: Path, max_in_flight: int | None, queue: bool,
          max_wait_ms: float = 5000, tail: str = "",
          env: dict[str, str] | None = None, section: str = "") -> Gateway:  # fmt: skip
    http, grpc, admin = free_port(), free_port(), free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "policy.yaml"
    path.write_text(policy(backend, http, grpc, admin, max_in_flight, queue, max_wait_ms, tail,
                           section))  # fmt: skip
    proc = Proc(["serve", "--policy", str(path)], tmp / "gateway.log", env=env)
    wait_ready(admin, proc)
    return Gateway(proc, path, http, grpc, admin)


@dataclass
class TenantRun:
    tenant: str
    completed: int = 0
    refused: dict[int, int] = field(default_factory=dict)  # HTTP status -> count
    ttft: list[float] = field(default_factory=list)  # seconds, completed requests
    tokens: list[tuple[float, int]] = field(default_factory=list)  # (finished at, cost served)
    waited_max: float = 0.0

    def p99_ttft(self) -> float:
        xs = sorted(self.ttft)
        return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("inf")

    def served(self, since: float = 0.0, until: float = 1e18) -> int:
        return sum(c for at, c in self.tokens if since <= at < until)


async def client(http: httpx.AsyncClient, url: str, run: TenantRun, tokens: int, until: float,
                 headers: dict[str, str] | None = None, delay: float = 0.0) -> None:  # fmt: skip
    """One closed-loop client: after `delay`, stream a completion of `tokens` tokens, again and
    again until `until`."""
    await asyncio.sleep(delay)
    body = {"model": "m", "max_tokens": tokens, "stream": True,
            "messages": [{"role": "user", "content": "hello " * 8}]}  # fmt: skip
    hdrs = {"x-tenant": run.tenant, **(headers or {})}
    while time.monotonic() < until:
        t0 = time.monotonic()
        first = None
        got = 0
        async with http.stream("POST", url, json=body, headers=hdrs) as r:
            if r.status_code != 200:
                await r.aread()
                run.refused[r.status_code] = run.refused.get(r.status_code, 0) + 1
                await asyncio.sleep(0.05)
                continue
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    doc = json.loads(line[6:])
                    if doc.get("choices") and doc["choices"][0].get("delta", {}).get("content"):
                        got += 1
                        if first is None:
                            first = time.monotonic() - t0
        end = time.monotonic()
        if end > until:
            break  # finished past the window: not counted (the alone / shared runs compare)
        run.completed += 1
        run.ttft.append(first if first is not None else end - t0)
        run.tokens.append((end, 12 + 2 * got))  # prompt ≈ 12 tokens × 1 + generated × 2


async def two_tenants(gw: Gateway, seconds: float, with_a: bool, b_clients: int = 2,
                      a_clients: int = 24) -> tuple[TenantRun, TenantRun]:  # fmt: skip
    """Tenant B: `b_clients` asking 16 tokens; tenant A (if `with_a`): `a_clients` asking 64,
    their starts spread over one of A's generations (0.65 s), as independent clients' are: the
    simulated backend's generations all last the same, so clients started at once would keep
    finishing at once, and every slot would free in bursts."""
    a, b = TenantRun("A"), TenantRun("B")
    url = f"{gw.http}/v1/chat/completions"
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), limits=limits) as http:
        until = time.monotonic() + seconds
        tasks = [client(http, url, b, 16, until) for _ in range(b_clients)]
        if with_a:
            tasks += [client(http, url, a, 64, until, delay=0.65 * i / a_clients)
                      for i in range(a_clients)]  # fmt: skip
        await asyncio.gather(*tasks)
    return a, b
