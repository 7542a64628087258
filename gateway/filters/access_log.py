"""(compiled) Structured access log: one JSON line per request, written through the batched sink.

Never logs bodies or credentials: only the header names the policy lists, minus a deny list.
"""

from __future__ import annotations

import logging
import time
from json.encoder import encode_basestring_ascii
from typing import Final

from gateway.context import RequestContext
from gateway.core.outcome import Outcome
from gateway.core.request import Wire
from gateway.core.verdict import ALLOW
from gateway.policy.model import AccessLog
from gateway.services import Services
from gateway.telemetry.accesslog import SINK, AccessLogSink

log: Final = logging.getLogger("sluice.access")

NEVER_LOGGED: Final = frozenset(
    {"authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key", "api-key"}
)

_str: Final = encode_basestring_ascii  # a JSON string literal, quotes and escapes included

# Milliseconds as text: ".000Z" ... ".999Z" (the timestamp's tail) and "000" ... "999" (a
# duration's fraction), looked up rather than formatted on every line.
_MS_Z: Final = tuple(f".{i:03d}Z" for i in range(1000))
_MS: Final = tuple(f"{i:03d}" for i in range(1000))
# By the member's id: an enum's `.value` and its hash are Python-level calls per read.
_PROTOCOL: Final = {id(p): p.value for p in Wire}
# The values that repeat from request to request (method, path, peer, route, backend, upstream)
# are learned as JSON literals: a lookup, not an escape and two joins, a request. Bounded: at
# most this many values of at most this many characters; past that, escaped as they come.
LEARNED_MAX: Final = 512
LEARNED_CHARS: Final = 128


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
        return self._prefix + _MS_Z[min(int((wall - sec) * 1000), 999)]


class AccessLogFilter:
    name = "access_log"

    def __init__(self, cfg: AccessLog, sink: AccessLogSink = SINK) -> None:
        # SLUICE_LOG_LEVEL=WARNING (or the `sluice.access` logger set above INFO) silences it too.
        self.enabled = cfg.enabled and log.isEnabledFor(logging.INFO)
        self._headers = tuple(
            (h.lower(), _str("h_" + h.lower()))
            for h in cfg.headers
            if h.lower() not in NEVER_LOGGED
        )
        self._sink = sink
        self._ts = _Timestamps()
        self._learned: dict[str, str] = {}

    def _literal(self, value: str) -> str:
        """`value` as a JSON string literal, quotes and escapes included."""
        literal = self._learned.get(value)
        if literal is None:
            literal = _str(value)
            if len(value) <= LEARNED_CHARS and len(self._learned) < LEARNED_MAX:
                self._learned[value] = literal
        return literal

    def on_response(self, ctx: RequestContext) -> None:
        # Formatted by hand rather than json.dumps of a dict (3x cheaper on the request path).
        # Strings are JSON literals (learned, `_literal`); numbers are numbers. The request id
        # needs no escaping: it is either made here (hex) or matched `[A-Za-z0-9._:-]`
        # (`gateway.filters.request_id`).
        info = ctx.info
        route, endpoint = ctx.route, ctx.endpoint
        # The duration in whole microseconds, written as milliseconds with three decimals.
        us = int(ctx.elapsed * 1_000_000 + 0.5)
        grpc = ctx.grpc_status
        quoted_route = "null" if route is None else self._literal(route.name)
        if endpoint is None:
            backend = upstream = "null"
        else:
            backend = self._literal(endpoint.backend)
            upstream = self._literal(endpoint.address)
        # An f-string is joined in one step; `%` parses its format on every line (2x the cost).
        line = (
            f'{{"ts":"{self._ts.format(ctx.started_wall)}","request_id":"{ctx.request_id}",'
            f'"protocol":"{_PROTOCOL[id(info.protocol)]}","method":{self._literal(info.method)},'
            f'"path":{self._literal(info.path[:512])},"peer":{self._literal(info.peer)},'
            f'"route":{quoted_route},'
            f'"backend":{backend},"upstream":{upstream},"status":{ctx.http_status},'
            f'"grpc_status":{"null" if grpc is None else str(grpc)},'
            f'"duration_ms":{us // 1000}.{_MS[us % 1000]},'
            f'"bytes_in":{ctx.bytes_in},"bytes_out":{ctx.bytes_out}'
        )
        if (
            ctx.outcome is not Outcome.OK
            or ctx.verdict is not ALLOW
            or ctx.trace_id
            or ctx.queue_wait is not None
            or ctx.principal is not None
            or ctx.detail
            or ctx.budget_warning
            or self._headers
        ):
            line += self._more(ctx)
        self._sink.emit(line + "}")

    def _more(self, ctx: RequestContext) -> str:
        """The optional fields (a plain OK request has none of them)."""
        more = ""
        if ctx.trace_id:  # tracing on: the id the backend saw too (traceparent)
            more += ',"trace_id":"' + ctx.trace_id.to_bytes(16, "big").hex() + '"'
        if ctx.error:
            more += f',"error":{_str(ctx.error)}'
        if ctx.cancelled:
            more += ',"cancelled":true'
        if not ctx.verdict.allowed:
            more += f',"rejected":{_str(ctx.verdict.error_type)}'
        if ctx.queue_wait is not None:  # through an admission queue: its wait, the class used
            more += f',"queue_wait_ms":{ctx.queue_wait * 1000:.3f},"class":{ctx.priority or 0}'
        principal = ctx.principal
        if principal is not None:  # who, never the token (provider names are policy-validated)
            more += ',"auth":' + self._literal(principal.provider)
        if ctx.detail:  # e.g. the auth reason class: "auth expired (corp)"
            more += f',"detail":{_str(ctx.detail)}'
        if ctx.budget_warning:  # budgets past a warn_at fraction: "team-month=0.8"
            more += f',"budget_warning":{_str(ctx.budget_warning)}'
        headers = ctx.info.headers
        for h, key in self._headers:
            value = headers.get(h)
            if value is not None:
                more += f",{key}:{_str(value[:256])}"
        return more


def build(section: AccessLog, services: Services) -> AccessLogFilter | None:
    f = AccessLogFilter(section)
    return f if f.enabled else None
