"""Health, Prometheus gauges and the admin API of the simulated backend.

On its HTTP listener: `/healthz[?deep=true]` and `/metrics` (vLLM's names, telling the truth
about its slots and queue: `gateway.mockbackend.vllm_metrics`), what a gateway's health checks
and load-aware balancing read.

On its own admin listener (loopback only, `--admin`, policy `mock_backend.admin`), never on the
listener a gateway forwards to: `/admin/knobs` (GET, POST partial update), `/admin/stats`,
`POST /admin/reset`, for tests and demos. The knobs can make the backend fail every request, so
they must not be reachable through a gateway's routes; the stats hold request ids and header
names, never a header value.
"""

from __future__ import annotations

import json
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gateway.mockbackend.http import MODELS, STATE, error_response
from gateway.mockbackend.knobs import MockState
from gateway.mockbackend.vllm_metrics import VllmGauges

METRICS_REGISTRY = web.AppKey("mock_metrics_registry", CollectorRegistry)


async def healthz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    status = 200 if state.knobs.healthy else 503
    body: dict[str, object] = {"status": "ok" if state.knobs.healthy else "unhealthy"}
    if request.query.get("deep", "").lower() in ("1", "true", "yes"):
        body |= {
            "knobs": state.knobs.as_dict(),
            "in_flight": state.stats.in_flight,
            "uptime_s": round(time.monotonic() - state.started, 3),
        }
    return web.json_response(body, status=status)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS_REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def get_knobs(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].knobs.as_dict())


async def post_knobs(request: web.Request) -> web.Response:
    try:
        patch = json.loads(await request.read())
        knobs = await request.app[STATE].update(patch)
    except (ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError
        return error_response(400, str(exc), "invalid_request_error")
    return web.json_response(knobs.as_dict())


async def get_stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    cache = state.cache
    prefix = {"blocks": len(cache.blocks), "hit_tokens": cache.stats.hit_tokens,
              "miss_tokens": cache.stats.miss_tokens}  # fmt: skip
    return web.json_response(state.stats.as_dict() | {"prefix_cache": prefix})


async def post_reset(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.stats.reset()
    state.cache.clear()  # the prefix cache starts cold too
    return web.json_response(state.stats.as_dict())


def add_health_routes(app: web.Application) -> None:
    """`/healthz` and `/metrics`, on the listener a gateway forwards to."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(VllmGauges(app[STATE], MODELS[0]))
    app[METRICS_REGISTRY] = registry
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)


def build_admin_app(state: MockState) -> web.Application:
    """The admin listener's whole application: knobs, stats and reset."""
    app = web.Application(client_max_size=64 * 1024)
    app[STATE] = state
    app.router.add_get("/admin/knobs", get_knobs)
    app.router.add_post("/admin/knobs", post_knobs)
    app.router.add_get("/admin/stats", get_stats)
    app.router.add_post("/admin/reset", post_reset)
    return app
