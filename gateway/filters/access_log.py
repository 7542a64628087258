"""Structured access log: one JSON line per request, written through the batched sink.

Never logs bodies or credentials: only the header names the policy lists, minus a deny list.
"""

from __future__ import annotations

import json
import logging
import time

from gateway.filters.base import RequestContext, Status
from gateway.policy.compiled import CompiledPolicy
from gateway.telemetry.accesslog import SINK, AccessLogSink

log = logging.getLogger("sluice.access")

NEVER_LOGGED = frozenset(
    {"authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key", "api-key"}
)

_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True).encode


class _Timestamps:
    """ISO-8601 UTC with milliseconds; the seconds part is formatted once per second."""

    __slots__ = ("_sec", "_prefix")

    def __init__(self) -> None:
        self._sec = -1
        self._prefix = ""

    def format(self, wall: float) -> str:
        sec = int(wall)
        if sec != self._sec:
            self._sec, self._prefix = sec, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
        return f"{self._prefix}.{int((wall - sec) * 1000):03d}Z"


class AccessLogFilter:
    name = "access_log"

    def __init__(self, policy: CompiledPolicy, sink: AccessLogSink = SINK) -> None:
        cfg = policy.policy.access_log
        # SLUICE_LOG_LEVEL=WARNING (or the `sluice.access` logger set above INFO) silences it too.
        self._enabled = cfg.enabled and log.isEnabledFor(logging.INFO)
        self._headers = tuple(h.lower() for h in cfg.headers if h.lower() not in NEVER_LOGGED)
        self._sink = sink
        self._ts = _Timestamps()

    async def on_request(self, ctx: RequestContext) -> Status:
        return Status.CONTINUE

    async def on_response(self, ctx: RequestContext) -> None:
        if not self._enabled:
            return
        info = ctx.info
        route, endpoint = ctx.route, ctx.endpoint
        entry: dict[str, object] = {
            "ts": self._ts.format(ctx.started_wall),
            "request_id": ctx.request_id,
            "protocol": info.protocol.value,
            "method": info.method,
            "path": info.path[:512],
            "peer": info.peer,
            "route": route.name if route is not None else None,
            "backend": endpoint.backend if endpoint is not None else None,
            "upstream": endpoint.address if endpoint is not None else None,
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
            value = info.headers.get(h)
            if value is not None:
                entry["h_" + h] = value[:256]
        self._sink.emit(_dumps(entry))
