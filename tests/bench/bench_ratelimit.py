"""Rate-limit benchmarks (by hand; not part of `make test`).

    .venv/bin/python tests/bench/bench_ratelimit.py core      # decisions/s, filter µs/request
    .venv/bin/python tests/bench/bench_ratelimit.py full      # the full chain's limits, by phase
    .venv/bin/python tests/bench/bench_ratelimit.py store     # through Redis: leased, strict
    .venv/bin/python tests/bench/bench_ratelimit.py gateway   # gateway CPU µs/request (wrk)
    .venv/bin/python tests/bench/bench_ratelimit.py overload  # 3x a simulated capacity
    .venv/bin/python tests/bench/bench_ratelimit.py all

`full` runs in this process the rate-limit part of `sluice bench --full` (its two rules and
priority, `gateway.bench.full`) for the bench's chat POST and for GET /v1/models: the request
phase, the body phase (`gateway.forward.body_phase`: parse, `from_doc`, `on_body`), the response
phase of a complete JSON answer with `usage` (`relay.on_head`, `relay.on_json`) and the finish
(`on_response`, `record_request`: its LLM metrics once the usage is read); each phase's µs per
request minus the same phase of the chain without `rate_limits`.

`core` and `store` run in this process (a private redis-server for `store`); `gateway` pins a
gateway process to --gateway-cpus and nginx (static /v1/models, the backend) plus wrk to
--load-cpus, and reads the gateway's CPU time around the measured run; `overload` puts a
capacity-limited simulated backend behind the gateway and offers 3x its capacity open-loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gateway.context import RequestContext  # noqa: E402
from gateway.core.keystate import KeyState, RuleMath  # noqa: E402
from gateway.core.request import RequestInfo, Wire  # noqa: E402
from gateway.filters.registry import build_chain  # noqa: E402
from gateway.policy.compiled import compile_policy  # noqa: E402
from gateway.policy.model import Policy  # noqa: E402
from gateway.services import Services  # noqa: E402

BIG = 1e9  # limits nobody reaches: the benchmark measures deciding, not refusing
RULES = [
    {"name": "per-ip", "key": ["source_ip"], "qps": BIG},
    {"name": "per-tenant", "key": ["header:x-tenant"], "qps": BIG,
     "tokens_per_second": BIG, "burst_tokens": BIG},
    {"name": "per-route", "key": ["route"], "qps": BIG},
]  # fmt: skip


# The same three keys without a token budget: no body or response phase for the limiter.
QPS_RULES = [{k: v for k, v in r.items() if k not in ("tokens_per_second", "burst_tokens")}
             for r in RULES]  # fmt: skip


def report(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


# ------------------------------------------------------------------------------- core
def bench_core_decisions(n: int = 1_000_000, keys: int = 1) -> float:
    m = RuleMath.of(qps=BIG, window_s=1.0, rate=BIG, burst=BIG)
    states = [KeyState(m, 1.0, 0.0) for _ in range(keys)]
    t0 = time.perf_counter()
    now = 1000.0
    for i in range(n):
        states[i % keys].request(m, 1.0, now + i * 1e-6)
    return n / (time.perf_counter() - t0)


def _policy(rules: list[dict[str, Any]], store: Any = "memory") -> Any:
    doc: dict[str, Any] = {
        "backends": [{"name": "a", "endpoints": [{"address": "127.0.0.1:1"}]}],
        "routes": [{"name": "r", "backend": "a"}],
        "access_log": {"enabled": False},
    }
    if rules:
        doc["rate_limits"] = {"store": store, "rules": rules}
    return compile_policy(Policy.model_validate(doc))


async def bench_filter(
    rules: list[dict[str, Any]], n: int = 200_000, store: Any = "memory", tenants: int = 100
) -> float:
    """µs per request of the whole chain's on_request + on_response (request id, ratelimit,
    route), minus the same chain without rate limits."""
    services = Services()
    p = _policy(rules, store)
    chain = build_chain(p, services)
    chain.activate()
    if rules and store != "memory":
        await asyncio.sleep(1.0)  # let the first leases arrive
    infos = [
        RequestInfo(Wire.HTTP, "GET", "/v1/models", {"x-tenant": f"t{i}"}, f"10.0.0.{i % 250}")
        for i in range(tenants)
    ]
    for i in range(1000):
        ctx = RequestContext(infos[i % tenants], p)
        await chain.on_request(ctx)
        await chain.on_response(ctx)
    t0 = time.perf_counter()
    for i in range(n):
        ctx = RequestContext(infos[i % tenants], p)
        await chain.on_request(ctx)
        await chain.on_response(ctx)
        if i % 500 == 0:
            await asyncio.sleep(0)  # a server yields between requests: let the sync loop run
    dt = time.perf_counter() - t0
    await services.aclose()
    return dt / n * 1e6


def cmd_core(_: argparse.Namespace) -> None:
    print("core decisions (KeyState.request: window + bucket + pressure + colour):")
    report(
        [
            ("1 key", f"{bench_core_decisions(keys=1) / 1e3:,.0f}k decisions/s"),
            ("10k keys", f"{bench_core_decisions(keys=10_000) / 1e3:,.0f}k decisions/s"),
        ]
    )
    print("filter chain, on_request + on_response per request (memory store, in process):")
    base = asyncio.run(bench_filter([]))
    one = asyncio.run(bench_filter(RULES[:1]))
    three = asyncio.run(bench_filter(RULES))
    report(
        [
            ("no rate_limits", f"{base:.2f} µs"),
            ("1 rule", f"{one:.2f} µs  (+{one - base:.2f})"),
            ("3 rules", f"{three:.2f} µs  (+{three - base:.2f})"),
        ]
    )


# ------------------------------------------------------------------------------- full
# `gateway.bench.full`'s rate limits, with limits that a run in process does not reach either
# (it decides ~1M requests/s: the bench's 1M qps would turn the keys yellow here).
FULL_LIMITS: dict[str, Any] = {
    "priority": {"from": "claim:tier", "classes": {"gold": 0, "free": 1}, "default": 1},
    "rules": [
        {"name": "per-tenant", "key": ["claim:tenant"], "qps": BIG, "tokens_per_second": BIG},
        {"name": "per-ip", "key": ["source_ip"], "qps": BIG},
    ],
}
QPS_LIMIT: dict[str, Any] = {"rules": [{"name": "per-ip", "key": ["source_ip"], "qps": BIG}]}
TOKEN_LIMIT: dict[str, Any] = {
    "rules": [{"name": "per-ip", "key": ["source_ip"], "tokens_per_second": BIG}]
}
PHASES = ("request", "body", "response", "finish")


def _response_phase() -> Any:
    """What `relay.relay` does with a complete JSON answer of 200 when the chain listens."""
    from gateway.forward import relay

    if hasattr(relay, "on_json"):
        on_head, on_json = relay.on_head, relay.on_json

        def phase(ctx: RequestContext, chain: Any, answer: bytes) -> None:
            on_head(ctx, chain, 200, [])
            on_json(ctx, chain, 200, answer)

        return phase
    # The base commit (f944163), for A/B: the same steps inline in `relay.relay`.
    from gateway.context import EventKind, StreamEvent
    from gateway.core.body import usage_from

    loads = relay._loads

    def base(ctx: RequestContext, chain: Any, answer: bytes) -> None:
        chain.on_event(ctx, StreamEvent(EventKind.HEAD, 200, raw_headers=[]))
        doc = loads(answer)
        u = usage_from(doc)
        if u is not None:
            ctx.usage = u
        chain.on_event(ctx, StreamEvent(EventKind.JSON, 200, answer, doc))

    return base


async def bench_phases(limits: dict[str, Any] | None, post: bool, n: int = 100_000) -> list[float]:
    """µs per request of each of `PHASES` for the chain of `limits` (None: none), on the bench's
    chat POST (`post`) or GET /v1/models; claims as the full chain's auth gives them."""
    from gateway.bench.loads import CHAT_BODY, CHAT_PATH
    from gateway.bench.procs import CHAT_JSON
    from gateway.context import Principal
    from gateway.forward.body_phase import body_phase
    from gateway.snapshot import Snapshot
    from gateway.telemetry.requests import record_request

    doc: dict[str, Any] = {
        "backends": [{"name": "a", "endpoints": [{"address": "127.0.0.1:1"}]}],
        "routes": [{"name": "r", "backend": "a"}],
        "access_log": {"enabled": False},
    }
    if limits is not None:
        doc["rate_limits"] = limits
    p = compile_policy(Policy.model_validate(doc))
    services = Services()
    chain = build_chain(p, services)
    chain.activate()
    snap = Snapshot(p, chain)
    body = CHAT_BODY.encode() if post else None
    answer = CHAT_JSON.encode() if post else b'{"object":"list","data":[{"id":"m"}]}'
    headers = {"content-type": "application/json"} if post else {}
    if post:
        headers["content-length"] = str(len(CHAT_BODY))
    info = RequestInfo(Wire.HTTP, "POST" if post else "GET", CHAT_PATH if post else
                       "/v1/models", headers, "10.0.0.1")  # fmt: skip
    claims = {"sub": "bench", "tenant": "t1", "tier": "gold"}
    principal = Principal("bench", "bench", claims)
    response_phase = _response_phase()
    has_body, listens = chain.has_body, chain.listens
    clock = time.perf_counter
    gc.collect()
    gc.freeze()  # as the server does once it is up
    best = [float("inf")] * len(PHASES)
    rounds = 8
    per = n // rounds
    for r in range(rounds + 1):
        t = [0.0] * len(PHASES)
        for _ in range(per):  # one request after the other, as a server sees them
            ctx = RequestContext(info, p)
            ctx.principal = principal
            t0 = clock()
            chain.run_request(ctx)
            t1 = clock()
            if has_body:
                body_phase(ctx, snap.chain, body, info.content_length)
            t2 = clock()
            if listens(ctx):
                response_phase(ctx, chain, answer)
            t3 = clock()
            chain.on_response_plain(ctx)
            record_request(ctx)  # its LLM metrics when the answer's usage was read
            t4 = clock()
            t[0] += t1 - t0
            t[1] += t2 - t1
            t[2] += t3 - t2
            t[3] += t4 - t3
        if r:  # the first round warms up
            best = [min(b, x / per * 1e6) for b, x in zip(best, t, strict=True)]
        await asyncio.sleep(0)
    gc.unfreeze()
    await services.aclose()
    return best


def cmd_full(_: argparse.Namespace) -> None:
    rows: list[tuple[str, str]] = []
    for post in (True, False):
        what = "chat POST" if post else "GET /v1/models"
        base = asyncio.run(bench_phases(None, post))
        variants = [("full chain's limits", FULL_LIMITS), ("1 QPS rule", QPS_LIMIT),
                    ("1 token rule", TOKEN_LIMIT)]  # fmt: skip
        for name, limits in variants:
            got = asyncio.run(bench_phases(limits, post))
            extra = [g - b for g, b in zip(got, base, strict=True)]
            parts = "  ".join(f"{ph} {e:+.2f}" for ph, e in zip(PHASES, extra, strict=True))
            rows.append((f"{what}, {name}", f"+{sum(extra):.2f} µs  ({parts})"))
    print("rate limits, in process, µs per request over the same chain without them:")
    report(rows)


# ------------------------------------------------------------------------------- store
@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    from gateway.bench.procs import free_port, wait_until

    port = free_port()
    d = tempfile.mkdtemp(prefix="sluice-bench-redis-")
    p = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", d],
        stdout=subprocess.DEVNULL,
    )
    try:
        import socket

        def up() -> bool:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                return True
            return False

        wait_until("redis", up, [p])
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        p.kill()
        p.wait()
        shutil.rmtree(d, ignore_errors=True)


async def bench_strict(url: str, seconds: float = 3.0, concurrency: int = 1) -> float:
    from redis.asyncio import Redis

    from gateway.store.base import KeyParams, SyncOp, key_name
    from gateway.store.redis import RedisStore

    client = Redis.from_url(url)
    store = RedisStore(client, deadline_s=1.0)
    await store.connect(5)
    p = KeyParams(BIG, 1.0, BIG, BIG)
    keys = [key_name("sluice", "bench", p, f"k{i}") for i in range(100)]
    done = 0
    end = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        nonlocal done
        i = w
        while time.perf_counter() < end:
            await store.take(SyncOp(keys[i % 100], p, offered=1, want_req=1, strict=True))
            done += 1
            i += concurrency

    t0 = time.perf_counter()
    cpu0 = time.process_time()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    dt, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    await client.aclose()
    return done / dt, cpu / done * 1e6


async def bench_sync(url: str, keys: int) -> float:
    """One lease sync of `keys` active keys: wall ms per round trip."""
    from redis.asyncio import Redis

    from gateway.store.base import KeyParams, SyncOp, key_name
    from gateway.store.redis import RedisStore

    client = Redis.from_url(url)
    store = RedisStore(client, deadline_s=5.0)
    await store.connect(5)
    p = KeyParams(BIG, 1.0, BIG, BIG)
    ops = [SyncOp(key_name("sluice", "sync", p, f"k{i}"), p, want_req=10) for i in range(keys)]
    await store.sync(ops)
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        await store.sync(ops)
        times.append(time.perf_counter() - t0)
    await client.aclose()
    return statistics.median(times) * 1000


def cmd_store(_: argparse.Namespace) -> None:
    with redis_server() as url:
        store = {"redis": {"url": url, "sync_interval_ms": 50}}
        leased1 = asyncio.run(bench_filter(RULES[:1], store=store))
        leased3 = asyncio.run(bench_filter(RULES, store=store))
        base = asyncio.run(bench_filter([]))
        s1, cpu1 = asyncio.run(bench_strict(url, concurrency=1))
        s64, cpu64 = asyncio.run(bench_strict(url, concurrency=64))
        sync100 = asyncio.run(bench_sync(url, 100))
        sync1000 = asyncio.run(bench_sync(url, 1000))
    print("through the Redis store:")
    report(
        [
            ("leased, 1 rule (filter)", f"{1e6 / leased1:,.0f} requests/s, {leased1:.2f} µs "
             f"(+{leased1 - base:.2f} over no limits)"),
            ("leased, 3 rules (filter)", f"{1e6 / leased3:,.0f} requests/s, {leased3:.2f} µs "
             f"(+{leased3 - base:.2f})"),
            ("strict, 1 in flight", f"{s1:,.0f} decisions/s, {cpu1:.0f} µs client CPU each"),
            ("strict, 64 in flight", f"{s64:,.0f} decisions/s, {cpu64:.0f} µs client CPU each"),
            ("one sync, 100 keys", f"{sync100:.2f} ms"),
            ("one sync, 1000 keys", f"{sync1000:.2f} ms"),
        ]
    )  # fmt: skip


# ------------------------------------------------------------------------------- gateway
def _gateway_rows(args: argparse.Namespace) -> None:
    from gateway.bench.loads import parse_wrk, wrk_cmd
    from gateway.bench.procs import Procs, free_port, http_ok, pinned, start_nginx, wait_until
    from gateway.bench.report import Row
    from gateway.bench.runner import measure

    tmp = Path(tempfile.mkdtemp(prefix="sluice-bench-rl-"))
    procs = Procs(tmp)
    results: list[tuple[str, str]] = []
    try:
        _, backend = start_nginx(procs, "nginx-backend", args.load_cpus, None)
        with redis_server() as url:
            variants: list[tuple[str, list[dict[str, Any]], Any]] = [
                ("limits off", [], "memory"),
                ("memory, 1 rule", RULES[:1], "memory"),
                ("memory, 3 QPS rules", QPS_RULES, "memory"),
                ("memory, 3 rules (1 with tokens)", RULES, "memory"),
                ("redis leased, 1 rule", RULES[:1], {"redis": {"url": url}}),
                ("redis leased, 3 QPS rules", QPS_RULES, {"redis": {"url": url}}),
                ("redis leased, 3 rules (1 with tokens)", RULES, {"redis": {"url": url}}),
                ("limits off (again)", [], "memory"),
            ]
            base = None
            for name, rules, store in variants:
                ports = {"http": free_port(), "grpc": free_port(), "admin": free_port()}
                doc = _bench_policy(ports, backend, args.engine)
                if rules:
                    doc["rate_limits"] = {"store": store, "rules": rules}
                path = tmp / f"{len(results)}.yaml"
                path.write_text(json.dumps(doc))
                cmd = [sys.executable, "-m", "gateway", "serve", "--policy", str(path),
                       "--log-level", "WARNING"]  # fmt: skip
                p = procs.start(f"gw{len(results)}", pinned(args.gateway_cpus, cmd))
                ready = f"http://127.0.0.1:{ports['admin']}/readyz"
                wait_until("gateway", lambda ready=ready: http_ok(ready), [p])  # type: ignore[misc]
                row = Row(name)
                url_ = f"http://127.0.0.1:{ports['http']}/v1/models"
                measure(row, wrk_cmd(args.load_cpus, args.connections, url_), parse_wrk,
                        args.duration, p.pid, {int(args.gateway_cpus)})  # fmt: skip
                procs.stop(p)
                cpu = row.cpu_us_per_req or 0.0
                if base is None:
                    base = cpu
                extra = "" if name.startswith("limits off") else f"  (+{cpu - base:.1f})"
                err = f"  ERROR {row.error}" if row.error else ""
                results.append((name, f"{row.rps:,.0f} req/s  {cpu:.1f} µs/req{extra}{err}"))
    finally:
        procs.stop_all()
    print(f"gateway CPU per request ({args.engine} engine, wrk -c{args.connections}, "
          f"{args.duration}s, GET /v1/models via nginx):")  # fmt: skip
    report(results)


def _bench_policy(ports: dict[str, int], backend: int, engine: str) -> dict[str, Any]:
    """The gateway under test: HTTP only, access log off, one backend (nginx) and one route."""
    return {
        "version": 1,
        "listeners": {
            "http": {"host": "127.0.0.1", "port": ports["http"], "engine": engine},
            "grpc": None,
            "admin": {"host": "127.0.0.1", "port": ports["admin"]},
        },
        "backends": [{"name": "bench-http", "endpoints": [{"address": f"127.0.0.1:{backend}"}]}],
        "routes": [{"name": "http", "match": {"protocol": "http"}, "backend": "bench-http"}],
        "access_log": {"enabled": False},
        "mock_backend": {"enabled": False},
    }


def cmd_gateway(args: argparse.Namespace) -> None:
    if not shutil.which("wrk") or not shutil.which("nginx"):
        print("gateway: needs wrk and nginx")
        return
    _gateway_rows(args)


# ------------------------------------------------------------------------------- overload
class Capacity:
    """A backend that serves `slots` requests at once, `service_s` each (FIFO beyond that):
    `slots / service_s` requests per second, and a queue that grows without bound above it,
    like a saturated inference server that keeps working on what it accepted."""

    def __init__(self, slots: int, service_s: float) -> None:
        self.slots = slots
        self.service_s = service_s
        self.sem: asyncio.Semaphore | None = None

    async def handle(self, request: Any) -> Any:
        from aiohttp import web

        if self.sem is None:
            self.sem = asyncio.Semaphore(self.slots)
        async with self.sem:
            await asyncio.sleep(self.service_s)
        return web.json_response({"object": "list", "data": []})


async def _overload_run(args: argparse.Namespace) -> list[tuple[str, str]]:
    import aiohttp
    from aiohttp import web

    from gateway.bench.procs import free_port, http_ok

    sys.path.insert(0, str(ROOT))
    from tests.integration.load import offer

    cap = Capacity(args.slots, args.service_ms / 1000)
    capacity = args.slots / cap.service_s
    runner = web.ServerRunner(web.Server(cap.handle), handler_cancellation=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    backend = runner.addresses[0][1]
    rows: list[tuple[str, str]] = []
    limiters: list[tuple[str, dict[str, Any] | None]] = [
        ("no limiter", None),
        ("qps limit = capacity", {"rules": [{"name": "cap", "key": [], "qps": capacity}]}),
        ("adaptive concurrency", {"concurrency": {"latency_slo_ms": args.service_ms * 2,
                                                  "initial_limit": args.slots * 4}}),
    ]  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="sluice-bench-ov-"))
    for name, rl in limiters:
        cap.sem = None
        port, admin = free_port(), free_port()
        doc: dict[str, Any] = {
            "listeners": {"http": {"host": "127.0.0.1", "port": port, "engine": args.engine},
                          "grpc": None, "admin": {"host": "127.0.0.1", "port": admin}},
            "access_log": {"enabled": False},
            "limits": {"max_connections_per_backend": 1024},
            "backends": [{"name": "cap", "endpoints": [{"address": f"127.0.0.1:{backend}"}]}],
            "routes": [{"name": "all", "backend": "cap"}],
        }  # fmt: skip
        if rl is not None:
            doc["rate_limits"] = rl
        path = tmp / f"{len(rows)}.yaml"
        path.write_text(json.dumps(doc))
        cmd = [sys.executable, "-m", "gateway", "serve", "--policy", str(path), "--log-level",
               "WARNING"]  # fmt: skip
        p = subprocess.Popen(  # noqa: ASYNC220 - a benchmark starting its gateway
            ["taskset", "-c", args.gateway_cpus, *cmd], stdout=subprocess.DEVNULL, cwd=ROOT
        )
        try:
            for _ in range(400):
                with contextlib.suppress(OSError):
                    if http_ok(f"http://127.0.0.1:{admin}/readyz"):
                        break
                await asyncio.sleep(0.05)
            url = f"http://127.0.0.1:{port}/v1/models"
            timeout = aiohttp.ClientTimeout(total=args.client_timeout)
            conn = aiohttp.TCPConnector(limit=2000)

            def models(i: int, url: str = url) -> tuple[str, str, dict[str, Any]]:
                return "GET", url, {}

            async with aiohttp.ClientSession(timeout=timeout, connector=conn) as s:
                await offer(s, capacity, 1.0, models, max_in_flight=2000)
                run = await offer(s, 3 * capacity, args.seconds, models, max_in_flight=2000)
            ok = [r for r in run.results if r.status == 200]
            lat = sorted(r.latency for r in ok)
            p99 = lat[int(len(lat) * 0.99)] * 1000 if lat else float("nan")
            goodput = len(ok) / args.seconds
            codes: dict[int, int] = {}
            for r in run.results:
                codes[r.status] = codes.get(r.status, 0) + 1
            share = f"{goodput / capacity:.0%} of {capacity:,.0f}"
            rows.append(
                (name, f"goodput {goodput:,.0f}/s ({share}), p99 of admitted {p99:,.0f} ms, "
                 f"answers {codes}")
            )  # fmt: skip
        finally:
            p.terminate()
            p.wait(10)
        await asyncio.sleep(args.service_ms / 1000 * 50)  # let the backend's queue drain
    await runner.cleanup()
    return rows


def cmd_overload(args: argparse.Namespace) -> None:
    rows = asyncio.run(_overload_run(args))
    print(f"overload: 3x a backend of {args.slots} slots x {args.service_ms} ms, "
          f"{args.seconds}s open loop, client timeout {args.client_timeout}s:")  # fmt: skip
    report(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("what", choices=["core", "full", "store", "gateway", "overload", "all"])
    ap.add_argument("--gateway-cpus", default="0")
    ap.add_argument("--load-cpus", default="1")
    ap.add_argument("--engine", default="native")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--duration", type=int, default=8)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--service-ms", type=float, default=50.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--client-timeout", type=float, default=2.0)
    args = ap.parse_args()
    os.chdir(ROOT)
    steps = {"core": cmd_core, "full": cmd_full, "store": cmd_store, "gateway": cmd_gateway,
             "overload": cmd_overload}  # fmt: skip
    for name, fn in steps.items():
        if args.what in (name, "all"):
            fn(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
