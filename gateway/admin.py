"""Admin listener (loopback by default): health, readiness, metrics, status page, policy.

GET  /healthz               200 while the process runs
GET  /readyz                200 once policy and listeners are up; 503 before and during drain
GET  /metrics               Prometheus text format (all workers' series under --workers N)
GET  /status                an HTML page an SRE can read: policy, routes, backends, in flight
GET  /admin/policy          current policy (JSON), version hash, last reload result, the
                            change guard's last report, a held change, the rollout, events
POST /admin/policy/reload   reload now; 200 with the new status (applied or unchanged), 202 a
                            staged rollout started, 409 held by the change guard, 422 the file
                            was rejected. Query: force=1 (past the guard), rollout=STAGES
                            (e.g. shadow,5,25,100; `none`: all at once), hold_s=SECONDS
GET  /admin/policy/traffic  the recent traffic the guard judges on (`sluice policy check
                            --against` reads it)
GET  /admin/policy/rollout  the running (or last) staged rollout; 404 if there never was one
POST /admin/policy/rollout/promote|abort   next stage now / back to the old policy now
(POST and the traffic are for loopback peers only, wherever the listener is bound)
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gateway.telemetry.metrics import IN_FLIGHT, REGISTRY

if TYPE_CHECKING:
    from gateway.server import Server


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


def build_admin_app(server: Server) -> web.Application:
    gw = server.gateway
    registry = _registry()

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        detail: dict[str, Any] = {
            "ready": gw.ready and not gw.draining,
            "draining": gw.draining,
            "policy_version": gw.holder.version,
            "in_flight": gw.inflight.count,
        }
        datapath = getattr(server, "datapath", None)
        if datapath is not None:
            detail["datapath"] = datapath.status()
        detail.update(gw.services.readiness())
        return _json(detail, 200 if detail["ready"] else 503)

    async def metrics(_: web.Request) -> web.Response:
        IN_FLIGHT.set(gw.inflight.count)  # exact for this process; other workers sample it
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

    async def status_page(_: web.Request) -> web.Response:
        return web.Response(text=render_status(server), content_type="text/html")

    app = web.Application(client_max_size=64 * 1024)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/status", status_page)
    app.router.add_get("/admin/policy", policy)
    app.router.add_post("/admin/policy/reload", reload)
    app.router.add_get("/admin/policy/traffic", traffic)
    app.router.add_get("/admin/policy/rollout", rollout_status)
    app.router.add_post(r"/admin/policy/rollout/{action:promote|abort}", rollout_action)
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


def render_status(server: Server) -> str:
    gw = server.gateway
    p = gw.active.policy
    st = gw.holder.status()
    last = st["last_reload"]
    assert isinstance(last, dict)
    e = html.escape
    rows_routes = "".join(
        f"<tr><td>{e(r.name)}</td><td>{e(r.protocol.value if r.protocol else 'any')}</td>"
        f"<td>{e(r.path_prefix)}</td><td>{e(', '.join(x.address for x in r.endpoints))}</td></tr>"
        for r in p.routes
    )
    rows_backends = "".join(
        f"<tr><td>{e(b.name)}</td><td>{e(b.protocol)}</td>"
        f"<td>{e(', '.join(f'{x.address} (w={x.weight})' for x in b.endpoints))}</td></tr>"
        for b in p.backends.values()
    )
    errors = "".join(f"<li><code>{e(x)}</code></li>" for x in last["errors"])
    held = gw.holder.held
    if held is not None:
        errors += f"<li><b>held</b> {e(str(held['version']))}: {e(str(held['reason']))}</li>"
    ro = gw.holder.rollout_status()
    if ro is not None:
        from gateway.policy.remote import rollout_lines

        errors += "".join(f"<li><code>{e(x)}</code></li>" for x in rollout_lines(ro))
    state = "draining" if gw.draining else ("ready" if gw.ready else "starting")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>Sluice status</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{border:1px solid #ccc;padding:4px 8px}}
table{{border-collapse:collapse}}</style></head><body>
<h1>Sluice</h1>
<p>State: <b>{state}</b> · in flight: {gw.inflight.count} · ports: {e(str(server.ports))}</p>
<p>Policy <code>{e(str(st["version"]))}</code> from <code>{e(str(st["path"]))}</code> ·
reloads: {st["reloads"]} · last reload: {"ok" if last["ok"] else "<b>rejected</b>"}</p>
<ul>{errors}</ul>
<h2>Routes (first match wins)</h2>
<table><tr><th>route</th><th>protocol</th><th>path prefix</th><th>endpoints</th></tr>
{rows_routes}</table>
<h2>Backends</h2>
<table><tr><th>backend</th><th>protocol</th><th>endpoints</th></tr>{rows_backends}</table>
</body></html>"""


async def start_admin(server: Server, host: str, port: int, *, reuse_port: bool) -> AdminListener:
    runner = web.AppRunner(build_admin_app(server), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None)
    await site.start()
    sockets = runner.addresses
    bound = int(sockets[0][1]) if sockets else port
    return AdminListener(runner, bound)
