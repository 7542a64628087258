"""Admin listener (loopback by default): health, readiness, metrics, status page, policy.

GET  /healthz               200 while the process runs
GET  /readyz                200 once policy and listeners are up; 503 before and during drain
GET  /metrics               Prometheus text format (all workers' series under --workers N);
                            OpenMetrics, with exemplars, when the scraper's Accept asks for it
GET  /status                the live status page (static files; see gateway.status)
GET  /admin/state           the JSON document the page reads (also for scripts)
GET  /admin/policy          current policy (JSON), version hash, last reload result, the
                            change guard's last report, a held change, the rollout, events
POST /admin/policy/reload   reload now; 200 with the new status (applied or unchanged), 202 a
                            staged rollout started, 409 held by the change guard, 422 the file
                            was rejected. Query: force=1 (past the guard), rollout=STAGES
                            (e.g. shadow,5,25,100; `none`: all at once), hold_s=SECONDS
GET  /admin/backends        backends' members: breaker, health, ejection, weight, load, in
                            flight, registry; routes' effective weights, canary guard, retry budget
GET  /admin/policy/traffic  the recent traffic the guard judges on (`sluice policy check
                            --against` reads it)
GET  /admin/policy/rollout  the running (or last) staged rollout; 404 if there never was one
POST /admin/policy/rollout/promote|abort   next stage now / back to the old policy now
GET  /admin/budgets/RULE/KEY  a token budget (POST .../grant?tokens=N, .../reset: loopback;
                            see gateway.budgets.admin)
GET  /admin/debug/heap      resident set, live objects by type, and (under tracemalloc) the
                            allocation sites holding most memory; `top=N` types
(POST, the traffic and the heap are for loopback peers only, wherever the listener is bound)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gateway.registry.pool import BACKENDS
from gateway.status import ASSETS, asset
from gateway.status.state import Served, StatusBoard
from gateway.telemetry import edge_metrics  # noqa: F401  (registers the edge metrics)
from gateway.telemetry.metrics import IN_FLIGHT, REGISTRY, flush


class AdminHost(Served, Protocol):
    """What the admin listener needs from the running server (`gateway.server.Server`): the
    state document's inputs and the reload it triggers."""

    def reload(
        self, force: bool = False, rollout_fields: dict[str, Any] | None = None, now: bool = False
    ) -> dict[str, object]: ...


BOARD = web.AppKey("board", StatusBoard)


class AdminListener:
    def __init__(self, runner: web.AppRunner, port: int) -> None:
        self._runner = runner
        self.port = port

    async def close(self) -> None:
        await self._runner.cleanup()


def _registry() -> CollectorRegistry:
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        return REGISTRY
    from prometheus_client import multiprocess

    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=path)  # type: ignore[no-untyped-call]
    return reg


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        text=json.dumps(data, indent=2, default=str), status=status, content_type="application/json"
    )


def build_admin_app(server: AdminHost) -> web.Application:
    gw = server.gateway
    registry = _registry()
    from gateway.admission import collector as admission_gauges
    from gateway.registry.collector import register

    register(registry)  # backend state gauges, read at scrape time
    register(registry, admission_gauges.COLLECTOR)  # queue lengths, read at scrape time

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        detail: dict[str, Any] = {
            "ready": gw.ready and not gw.draining,
            "draining": gw.draining,
            "policy_version": gw.holder.version,
            "in_flight": gw.inflight.count,
        }
        if server.datapath is not None:
            detail["datapath"] = server.datapath.status()
        detail.update(gw.services.readiness())
        return _json(detail, 200 if detail["ready"] else 503)

    async def metrics(request: web.Request) -> web.Response:
        IN_FLIGHT.set(gw.inflight.count)  # exact for this process; other workers sample it
        flush()  # this process's request tallies; other workers flush theirs every second
        if "application/openmetrics-text" in request.headers.get("Accept", ""):
            # OpenMetrics carries the exemplars (trace ids of kept traces).
            from prometheus_client.openmetrics import exposition as om

            body = om.generate_latest(registry)  # type: ignore[no-untyped-call]
            return web.Response(body=body, headers={"Content-Type": om.CONTENT_TYPE_LATEST})
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def policy(_: web.Request) -> web.Response:
        return _json(
            {
                "status": gw.holder.status(),
                "policy": gw.active.policy.policy.model_dump(mode="json"),
            }
        )

    def loopback(request: web.Request) -> bool:
        # The admin port may be opened to Prometheus (0.0.0.0 in Kubernetes); changing state
        # (and reading request paths) stays a loopback-only right.
        peer = request.transport.get_extra_info("peername") if request.transport else None
        return peer is not None and peer[0] in ("127.0.0.1", "::1", "::ffff:127.0.0.1")

    forbidden = {"error": {"type": "forbidden", "message": "loopback only"}}

    async def reload(request: web.Request) -> web.Response:
        if not loopback(request):
            return _json(forbidden, 403)
        try:
            force, fields, now = reload_options(request.query)
        except ValueError as e:
            return _json({"error": {"type": "bad_request", "message": str(e)}}, 400)
        status = server.reload(force=force, rollout_fields=fields, now=now)
        r = gw.holder.last_result
        code = 422 if not r.ok else 409 if r.held else 202 if r.rollout else 200
        return _json(status, code)

    async def traffic(request: web.Request) -> web.Response:
        if not loopback(request):
            return _json(forbidden, 403)
        return _json(gw.traffic.snapshot().as_json())

    async def rollout_status(_: web.Request) -> web.Response:
        st = gw.holder.rollout_status()
        if st is None:
            return _json({"error": {"type": "not_found", "message": "no rollout"}}, 404)
        return _json(st)

    async def rollout_action(request: web.Request) -> web.Response:
        if not loopback(request):
            return _json(forbidden, 403)
        holder = gw.holder
        action = request.match_info["action"]
        st = holder.promote() if action == "promote" else holder.abort("aborted by hand")
        if st is None:
            return _json({"error": {"type": "not_found", "message": "no rollout running"}}, 404)
        return _json(st)

    async def heap(request: web.Request) -> web.Response:
        if not loopback(request):
            return _json(forbidden, 403)
        from gateway.telemetry.heap import TOP_TYPES, heap_report

        try:
            top = min(1000, max(1, int(request.query.get("top", TOP_TYPES))))
        except ValueError:
            return _json({"error": {"type": "bad_request", "message": "top: a number"}}, 400)
        return _json(heap_report(top))

    async def backends(_: web.Request) -> web.Response:
        pool = gw.services.peek(BACKENDS)
        return _json(pool.state() if pool is not None else {"backends": {}, "routes": {}})

    board = StatusBoard(server, registry)
    pages = {name: asset(name) for name in ASSETS}  # read once: the files ship in the package

    async def status_page(request: web.Request) -> web.Response:
        name = request.match_info.get("name", "index.html")
        if name not in pages:
            raise web.HTTPNotFound()
        body, content_type = pages[name]
        return web.Response(
            body=body, content_type=content_type, headers={"Cache-Control": "no-cache"}
        )

    async def state(_: web.Request) -> web.Response:
        return web.Response(
            text=json.dumps(board.state(), separators=(",", ":"), default=str),
            content_type="application/json",
            headers={"Cache-Control": "no-store"},
        )

    app = web.Application(client_max_size=64 * 1024)
    app[BOARD] = board
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/status", status_page)
    app.router.add_get("/status/{name}", status_page)
    app.router.add_get("/admin/state", state)
    app.router.add_get("/admin/policy", policy)
    app.router.add_get("/admin/backends", backends)
    app.router.add_post("/admin/policy/reload", reload)
    app.router.add_get("/admin/policy/traffic", traffic)
    app.router.add_get("/admin/policy/rollout", rollout_status)
    app.router.add_post(r"/admin/policy/rollout/{action:promote|abort}", rollout_action)
    app.router.add_get("/admin/debug/heap", heap)
    from gateway.budgets.admin import add_routes as budget_routes

    budget_routes(app, gw.services, loopback)
    return app


def reload_options(query: Mapping[str, str]) -> tuple[bool, dict[str, Any] | None, bool]:
    """(force, rollout fields, all at once) from the reload endpoint's query; ValueError."""
    force = query.get("force", "0").lower() in ("1", "true", "yes")
    fields: dict[str, Any] = {}
    now = False
    stages = query.get("rollout")
    if stages is not None:
        if stages.lower() in ("none", "0", "off", "false"):
            now = True
        else:
            fields["stages"] = [
                s if s == "shadow" else float(s) for s in (x.strip() for x in stages.split(","))
            ]
    hold = query.get("hold_s")
    if hold is not None:
        fields["hold_s"] = float(hold)
    if fields:
        from gateway.policy.model import Rollout

        try:
            Rollout.model_validate(fields)
        except ValueError as e:
            raise ValueError(f"rollout: {e}") from None
    return force, fields or None, now


async def start_admin(
    server: AdminHost, host: str, port: int, *, reuse_port: bool
) -> AdminListener:
    runner = web.AppRunner(build_admin_app(server), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None)
    await site.start()
    # The colour history and the "recent" counter window (a task the services cancel at stop).
    server.gateway.services.spawn(runner.app[BOARD].run(), "status-board")
    sockets = runner.addresses
    bound = int(sockets[0][1]) if sockets else port
    return AdminListener(runner, bound)
