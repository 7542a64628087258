"""Structured access log: one JSON line per request on the `sluice.access` logger.

Never logs bodies or credentials: only the header names the policy lists, minus a deny list.
"""

from __future__ import annotations

import json
import logging
import time

from gateway.filters.base import RequestContext, Status
from gateway.policy.compiled import CompiledPolicy

log = logging.getLogger("sluice.access")

NEVER_LOGGED = frozenset(
    {"authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key", "api-key"}
)


class AccessLogFilter:
    name = "access_log"

    def __init__(self, policy: CompiledPolicy) -> None:
        cfg = policy.policy.access_log
        self._enabled = cfg.enabled
        self._headers = tuple(h.lower() for h in cfg.headers if h.lower() not in NEVER_LOGGED)

    async def on_request(self, ctx: RequestContext) -> Status:
        return Status.CONTINUE

    async def on_response(self, ctx: RequestContext) -> None:
        if not self._enabled or not log.isEnabledFor(logging.INFO):
            return
        info = ctx.info
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ctx.started_wall))
            + f".{int(ctx.started_wall % 1 * 1000):03d}Z",
            "request_id": ctx.request_id,
            "protocol": info.protocol.value,
            "method": info.method,
            "path": info.path[:512],
            "peer": info.peer,
            "route": ctx.route.name if ctx.route else None,
            "backend": ctx.endpoint.backend if ctx.endpoint else None,
            "upstream": ctx.endpoint.address if ctx.endpoint else None,
            "status": ctx.http_status,
            "grpc_status": ctx.grpc_status,
            "duration_ms": round(ctx.elapsed * 1000, 3),
            "bytes_in": ctx.bytes_in,
            "bytes_out": ctx.bytes_out,
        }
        if ctx.error:
            entry["error"] = ctx.error
        if ctx.cancelled:
            entry["cancelled"] = True
        if not ctx.verdict.allowed:
            entry["rejected"] = ctx.verdict.error_type
        for h in self._headers:
            if h in info.headers:
                entry["h_" + h] = info.headers[h][:256]
        log.info(json.dumps(entry, separators=(",", ":")))
