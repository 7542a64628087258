"""`sluice heartbeat`: the agent beside a model server that publishes its heartbeat to Redis.

Every `--interval` seconds it scrapes the server's vLLM-style `/metrics` and publishes
`sid`, `addr`, `load`, `ver`, `ts` with a TTL (`--ttl`, default 5 s, the gateway's staleness
bound). `load` (0-100) is `100 × max(KV-cache use, (running + waiting) / --max-running)` from
`vllm:kv_cache_usage_perc` (or the older `vllm:gpu_cache_usage_perc`),
`vllm:num_requests_running` and `vllm:num_requests_waiting`, summed over models. A scrape that
fails publishes nothing, so a dead server leaves rotation when its TTL runs out; SIGTERM removes
the heartbeat at once. The Redis URL may come from `SLUICE_HEARTBEAT_REDIS` (keeps a password
out of `ps`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time

log = logging.getLogger("sluice.heartbeat")

MAX_METRICS_BYTES = 4 << 20
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis", default=os.environ.get("SLUICE_HEARTBEAT_REDIS"),
                        help="registry URL (default $SLUICE_HEARTBEAT_REDIS)")  # fmt: skip
    parser.add_argument("--service", required=True, help="service name the gateway discovers")
    parser.add_argument("--address", required=True, help="host:port the gateway connects to")
    parser.add_argument("--sid", default=None, help="member id (default: the address)")
    parser.add_argument("--ver", default="", help="version label (canary routing by version)")
    parser.add_argument("--metrics-url", default=None,
                        help="vLLM-style metrics (default http://ADDRESS/metrics)")  # fmt: skip
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between beats")
    parser.add_argument("--ttl", type=float, default=5.0, help="heartbeat lifetime (s)")
    parser.add_argument("--max-running", type=int, default=256,
                        help="requests at which it counts as full (vLLM max_num_seqs)")  # fmt: skip
    parser.add_argument("--once", action="store_true", help="publish one heartbeat and exit")
    parser.add_argument("--log-level", default="INFO")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {name: value}, summing series of a name (max for KV-cache use)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_part, _, rest = line.partition(" ")
        name = name_part.split("{", 1)[0]
        if "}" in name_part or "{" in name_part:
            # labels may hold spaces: the value follows the closing brace
            close = line.rfind("}")
            rest = line[close + 1 :]
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if value != value:  # NaN
            continue
        if name in KV:
            out[name] = max(out.get(name, 0.0), value)
        else:
            out[name] = out.get(name, 0.0) + value
    return out


def compute_load(metrics: dict[str, float], max_running: int) -> float:
    kv = max((metrics.get(k, 0.0) for k in KV), default=0.0)
    queued = (metrics.get(RUNNING, 0.0) + metrics.get(WAITING, 0.0)) / max(1, max_running)
    return round(min(100.0, max(0.0, 100.0 * max(kv, queued))), 1)


async def scrape(url: str, timeout: float) -> dict[str, float]:
    import aiohttp

    t = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(timeout=t) as session, session.get(url) as resp:
        if resp.status != 200:
            raise OSError(f"metrics answered {resp.status}")
        body = await resp.content.read(MAX_METRICS_BYTES)
    return parse_metrics(body.decode("utf-8", "replace"))


async def _run(args: argparse.Namespace) -> int:
    from redis.asyncio import Redis

    from gateway.registry.heartbeats import Heartbeat, publish, withdraw

    if not args.redis:
        log.error("no Redis URL: pass --redis or set SLUICE_HEARTBEAT_REDIS")
        return 2
    sid = args.sid or args.address
    url = args.metrics_url or f"http://{args.address}/metrics"
    client = Redis.from_url(args.redis, socket_timeout=2.0, socket_connect_timeout=2.0)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    failing = False
    try:
        while not stop.is_set():
            try:
                load = compute_load(await scrape(url, args.interval * 2), args.max_running)
                hb = Heartbeat(sid, args.address, load, args.ver, time.time_ns())
                async with asyncio.timeout(2.0):
                    await publish(client, args.service, hb, args.ttl)
                if failing:
                    log.info("heartbeat resumed: %s load %.1f", sid, load)
                failing = False
            except Exception as e:  # server or Redis down: say so once, keep trying
                if not failing:
                    log.warning("heartbeat not published (%s: %s)", type(e).__name__, e)
                failing = True
            if args.once:
                return 1 if failing else 0
            try:
                async with asyncio.timeout(args.interval):
                    await stop.wait()
            except TimeoutError:
                pass
        try:
            async with asyncio.timeout(2.0):
                await withdraw(client, args.service, sid)
        except Exception as e:
            log.warning("could not withdraw the heartbeat: %s", e)
        return 0
    finally:
        await client.aclose()


def run(args: argparse.Namespace) -> int:
    import uvloop

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    code: int = uvloop.run(_run(args))
    return code
