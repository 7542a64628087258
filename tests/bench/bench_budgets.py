"""Token-budget benchmark (by hand; not part of `make test`): the budget filter's CPU per request
in this process, for one rule, without a store and with one (a private redis-server, shares
leased in the background: the CPU of the sync loop is in the figure), the three hooks a chat
POST meets (request, body, response with `usage`). CPU time of this process
(`time.process_time`), so a busy machine slows it less than wall time would.

    .venv/bin/python tests/bench/bench_budgets.py [--requests N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gateway.context import Principal, RequestContext  # noqa: E402
from gateway.core.body import Usage, from_doc  # noqa: E402
from gateway.core.request import RequestInfo, Wire  # noqa: E402
from gateway.filters.budget import build  # noqa: E402
from gateway.fleet.store import configure_fleet  # noqa: E402
from gateway.policy.compiled import compile_policy  # noqa: E402
from gateway.policy.model import Policy  # noqa: E402
from gateway.services import Services  # noqa: E402

RAW = b'{"model":"m","max_tokens":16,"messages":[{"role":"user","content":"hello there"}]}'


def policy(store: str | None) -> Any:
    doc: dict[str, Any] = {
        "backends": [{"name": "b", "endpoints": [{"address": "127.0.0.1:1"}]}],
        "routes": [{"name": "r", "backend": "b"}],
        "budgets": {
            "rules": [
                {
                    "name": "month",
                    "key": ["claim:tenant"],
                    "tokens": 10**15,
                    "period": {"calendar": "month"},
                }
            ]
        },  # fmt: skip
    }
    if store:
        doc["store"] = {"redis": {"url": store}}
    return compile_policy(Policy.model_validate(doc))


async def measure(store: str | None, n: int) -> float:
    cp = policy(store)
    services = Services()
    if store:
        fleet = configure_fleet(cp.policy, services)
        while not fleet.shared:
            await asyncio.sleep(0.01)
    f = build(cp, services)
    assert f is not None
    f.activate()
    info = RequestInfo(Wire.HTTP, "POST", "/v1/chat/completions",
                       {"content-type": "application/json"}, "127.0.0.1", "", len(RAW))  # fmt: skip
    who = Principal("p", "s", {"tenant": "t1"})
    body = from_doc(RAW, json.loads(RAW))
    usage = Usage(3, 16)
    ctxs = [RequestContext(info, cp) for _ in range(n)]
    for c in ctxs:
        c.principal = who
    best = float("inf")
    for run in range(4):  # the first warms up (and leases the key's first share)
        t = time.process_time()
        for i, c in enumerate(ctxs):
            if i % 64 == 0:
                await asyncio.sleep(0)  # as a server does between requests: the sync loop runs
            c.budget = None
            r = f.on_request(c)
            if hasattr(r, "__await__"):
                await r  # type: ignore[misc]
            f.on_body(c, body)
            c.usage = usage
            f.on_response(c)
        if run:
            best = min(best, (time.process_time() - t) / n * 1e6)
        await asyncio.sleep(0.05)  # the sync loop runs (with a store)
    await services.aclose()
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=100_000)
    args = ap.parse_args()
    print(f"budget filter, 1 rule, memory: {asyncio.run(measure(None, args.requests)):.2f} µs CPU")
    from tests.redis_support import RedisServer

    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            us = asyncio.run(measure(server.url, args.requests))
        finally:
            server.stop()
    print(f"budget filter, 1 rule, Redis (leased shares): {us:.2f} µs CPU")


if __name__ == "__main__":
    main()
