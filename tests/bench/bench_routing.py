"""The route filter's own cost per request, in process: `python -m tests.bench.bench_routing`.

Prints µs per request (the best of several rounds) for today's route filter (head match, least
loaded of 4 members: `on_request` + `on_response`) and for the LLM-aware one on a by_model
route over two backends with prefix affinity (`on_request` + `on_body` + `on_response`: the
model's backends and members, the prefix hash of a 2 KB system prompt, the bounded-load
rendezvous walk). The body is parsed outside the timed part (the body phase parses it once for
every filter; its cost is printed on its own line). Budget: model routing + affinity ≤ 5 µs
over today's route filter.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from gateway import jsonfast
from gateway.context import RequestContext
from gateway.core import body as bodies
from gateway.core.request import RequestInfo, Wire
from gateway.filters.model_routing import ModelRouteFilter
from gateway.filters.routing import RouteFilter
from gateway.policy.compiled import compile_policy
from gateway.policy.model import Policy
from gateway.registry.pool import BackendPool
from gateway.services import Services

ROUNDS = 7
N = 20000
SYSTEM = "You are a careful assistant. " * 73  # ~2 KB


def policy(llm: bool) -> Any:
    eps = [{"address": f"127.0.0.1:{9000 + i}"} for i in range(4)]
    backends: list[dict[str, Any]] = [{"name": "llama", "endpoints": eps}]
    route: dict[str, Any] = {"name": "openai", "match": {"path_prefix": "/v1/"}}
    if llm:
        backends[0]["models"] = {"names": ["llama-3-8b"]}
        backends.append({"name": "qwen", "endpoints": [{"address": "127.0.0.1:9100"}],
                         "models": {"names": ["qwen-7b"]}})  # fmt: skip
        route |= {"backends": [{"backend": "llama"}, {"backend": "qwen"}], "by_model": True,
                  "affinity": {"prefix": {"bytes": 2048, "load_factor": 1.25}}}  # fmt: skip
    else:
        route["backend"] = "llama"
    return compile_policy(Policy.model_validate({"backends": backends, "routes": [route]}))


def per_call(llm: bool, raws: list[bytes]) -> float:
    cp = policy(llm)
    pool = BackendPool(Services())
    f = ModelRouteFilter(cp, pool) if llm else RouteFilter(cp, pool)
    f.activate()
    info = RequestInfo(Wire.HTTP, "POST", "/v1/chat/completions", {})
    docs = [bodies.from_doc(r, jsonfast.loads(r)) for r in raws]
    best = float("inf")
    for _ in range(ROUNDS):
        ctxs = [RequestContext(info, cp) for _ in docs]
        t = time.perf_counter()
        for ctx, b in zip(ctxs, docs, strict=True):
            f.on_request(ctx)
            if llm:
                assert isinstance(f, ModelRouteFilter)
                f.on_body(ctx, b)
            f.on_response(ctx)
        best = min(best, (time.perf_counter() - t) / len(ctxs))
        assert ctxs[-1].endpoint is not None
    return best * 1e6


def parse_cost(raws: list[bytes]) -> float:
    best = float("inf")
    for _ in range(ROUNDS):
        t = time.perf_counter()
        for r in raws:
            bodies.from_doc(r, jsonfast.loads(r))
        best = min(best, (time.perf_counter() - t) / len(raws))
    return best * 1e6


def main() -> int:
    raws = [
        json.dumps({"model": "llama-3-8b", "stream": True, "max_tokens": 64, "messages": [
            {"role": "system", "content": SYSTEM + str(i % 32)},
            {"role": "user", "content": f"question {i}"}]}).encode()
        for i in range(N)
    ]  # fmt: skip
    today = per_call(False, raws)
    llm = per_call(True, raws)
    print(f"{'route filter today (least loaded of 4)':48} {today:7.2f} µs/request")
    print(f"{'by_model + prefix affinity (2 KB prompt)':48} {llm:7.2f} µs/request")
    print(f"{'difference (budget 5 µs)':48} {llm - today:7.2f} µs/request")
    print(f"{'body parse (JSON, shared by every on_body)':48} {parse_cost(raws):7.2f} µs/request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
