"""A kept request as a compact record, and that record as OpenTelemetry SDK spans.

`record_of(ctx, ...)` copies, when the tail sampler keeps a request, the few facts its spans
need out of the request context (never bodies, tokens or header values other than the ones
listed here), so that the context can go. `emit(tracer, ids, record)` builds, off the request
path, a server span (HTTP or RPC semantic conventions) with the filters' decisions as events,
and a client span per upstream try, with their real start and end times, and ends them, which
hands them to the tracer's span processor.

Times: the context keeps `time.monotonic()` values and one wall-clock anchor (`started_wall`
at `started`); span times are the anchor plus the monotonic offset, so a wall clock step in the
middle of a request does not bend its spans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry import trace as api
from opentelemetry.context import Context
from opentelemetry.sdk.trace.id_generator import IdGenerator

from gateway.core.outcome import Outcome
from gateway.core.sampler import SampleDecision
from gateway.core.traceparent import client_span_id

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

    from gateway.context import Decision, RequestContext, UpstreamTry

MAX_PATH = 256
MAX_DETAIL = 256


@dataclass(slots=True)
class TraceRecord:
    trace_id: int
    span_id: int
    parent_span_id: int
    keep: SampleDecision
    protocol: str
    method: str
    path: str
    authority: str
    peer: str
    route: str | None
    backend: str | None
    address: str | None
    request_id: str
    outcome: Outcome
    rejected: str  # the verdict's error type when Sluice refused ("" otherwise)
    detail: str
    http_status: int
    grpc_status: int | None
    bytes_in: int
    bytes_out: int
    attempts: int
    anchor_wall: float  # wall time at `anchor`
    anchor: float  # monotonic time of the request's start
    ended: float
    first_byte_at: float | None
    first_token_at: float | None
    last_token_at: float | None
    stream_events: int
    tries: list[UpstreamTry] | None
    decisions: list[Decision] | None
    model: str | None
    max_tokens: int | None
    stream: bool
    input_tokens: int | None
    output_tokens: int | None
    queue_wait: float | None = None  # seconds in the admission queue (None: no queue)
    priority: int | None = None  # the effective class the limits and the queue used

    @property
    def spans(self) -> int:
        return 1 + (len(self.tries) if self.tries else 0)


def record_of(
    ctx: RequestContext, keep: SampleDecision, ended: float, max_spans: int
) -> TraceRecord:
    info = ctx.info
    route, endpoint, body, usage = ctx.route, ctx.endpoint, ctx.body, ctx.usage
    tries = ctx.tries
    if tries is not None and len(tries) >= max_spans:
        tries = tries[: max_spans - 1]
    return TraceRecord(
        ctx.trace_id,
        ctx.span_id,
        ctx.parent_span_id,
        keep,
        info.protocol.value,
        info.method,
        info.path[:MAX_PATH],
        info.authority[:MAX_PATH],
        info.peer,
        route.name if route is not None else None,
        endpoint.backend if endpoint is not None else None,
        endpoint.address if endpoint is not None else None,
        ctx.request_id,
        ctx.outcome,
        "" if ctx.verdict.allowed else ctx.verdict.error_type,
        ctx.detail[:MAX_DETAIL],
        ctx.http_status,
        ctx.grpc_status,
        ctx.bytes_in,
        ctx.bytes_out,
        ctx.attempts,
        ctx.started_wall,
        ctx.started,
        ended,
        ctx.first_byte_at,
        ctx.first_token_at,
        ctx.last_token_at,
        ctx.stream_events,
        tries,
        ctx.decisions,
        body.model if body is not None else None,
        body.max_tokens if body is not None else None,
        body.stream if body is not None else False,
        usage.prompt_tokens if usage is not None else None,
        usage.completion_tokens if usage is not None else None,
        ctx.queue_wait,
        ctx.priority,
    )


class PresetIds(IdGenerator):
    """An SDK id generator that hands out the ids Sluice chose (the server span's was sent
    upstream already, inside the traceparent); set `trace_id` / `span_id` before each span."""

    def __init__(self) -> None:
        self.trace_id = 0
        self.span_id = 0

    def generate_span_id(self) -> int:
        return self.span_id

    def generate_trace_id(self) -> int:
        return self.trace_id

    def is_trace_id_random(self) -> bool:
        return True  # ours, or the client's (W3C asks for random ones)


def emit(tracer: Tracer, ids: PresetIds, r: TraceRecord) -> int:
    """Build and end the spans of one kept request; returns how many."""

    def ns(mono: float) -> int:
        return int((r.anchor_wall + (mono - r.anchor)) * 1e9)

    grpc = r.protocol == "grpc"
    if r.parent_span_id:
        remote = api.SpanContext(
            r.trace_id, r.parent_span_id, is_remote=True, trace_flags=api.TraceFlags(1)
        )
        parent = api.set_span_in_context(api.NonRecordingSpan(remote))
    else:
        parent = Context()
    ids.trace_id, ids.span_id = r.trace_id, r.span_id
    server = tracer.start_span(
        _server_name(r),
        parent,
        kind=api.SpanKind.SERVER,
        attributes=_server_attributes(r),
        start_time=ns(r.anchor),
    )
    for d in r.decisions or ():
        event = {"sluice.filter": d.filter}
        if d.detail:
            event["sluice.detail"] = d.detail
        server.add_event(d.name, event, timestamp=ns(d.at))
    if r.first_token_at is not None:
        server.add_event("first_token", timestamp=ns(r.first_token_at))
    error = _error_type(r)
    if error:
        server.set_status(api.Status(api.StatusCode.ERROR, r.detail or error))
    count = 1
    inside = api.set_span_in_context(server)
    for i, t in enumerate(r.tries or ()):
        ids.span_id = client_span_id(r.span_id, i)
        attrs: dict[str, Any] = {
            "sluice.backend": t.backend,
            "sluice.attempt": i + 1,
            "server.address": t.address.rpartition(":")[0].strip("[]"),
        }
        port = t.address.rpartition(":")[2]
        if port.isdigit():
            attrs["server.port"] = int(port)
        if grpc:
            attrs["rpc.system"] = "grpc"
            attrs["rpc.grpc.status_code"] = t.status
        else:
            attrs["http.request.method"] = r.method
            if t.status:
                attrs["http.response.status_code"] = t.status
        if t.error:
            attrs["error.type"] = t.error
        client = tracer.start_span(
            r.path[1:] if grpc else r.method,
            inside,
            kind=api.SpanKind.CLIENT,
            attributes=attrs,
            start_time=ns(t.started),
        )
        if t.first_byte_at is not None:
            client.add_event("first_byte", timestamp=ns(t.first_byte_at))
        if t.error or (not grpc and t.status >= 500) or (grpc and t.status):
            client.set_status(api.Status(api.StatusCode.ERROR, t.error or str(t.status)))
        client.end(end_time=ns(t.ended or r.ended))
        count += 1
    server.end(end_time=ns(r.ended))
    return count


def _server_name(r: TraceRecord) -> str:
    if r.protocol == "grpc":
        return r.path[1:] or "grpc"  # RPC conventions: "pkg.Service/Method"
    return f"{r.method} {r.route}" if r.route else r.method


def _error_type(r: TraceRecord) -> str:
    if r.rejected:
        return r.rejected
    if r.outcome is not Outcome.OK:
        return str(r.outcome.value)
    if r.protocol == "grpc":
        return str(r.grpc_status) if r.grpc_status else ""
    return str(r.http_status) if r.http_status >= 500 else ""


def _server_attributes(r: TraceRecord) -> dict[str, Any]:
    a: dict[str, Any] = {
        "sluice.request_id": r.request_id,
        "sluice.outcome": r.outcome.value,
        "sluice.sampling.reason": r.keep.reason.value,
        "sampling.adjusted_count": r.keep.adjusted_count,
        "sluice.attempts": r.attempts,
        "client.address": r.peer.rpartition(":")[0].strip("[]") or r.peer,
    }
    if r.route:
        a["sluice.route"] = r.route
    if r.backend:
        a["sluice.backend"] = r.backend
    if r.address:
        a["sluice.upstream"] = r.address
    if r.rejected:
        a["sluice.rejected"] = r.rejected
    error = _error_type(r)
    if error:
        a["error.type"] = error
    if r.protocol == "grpc":
        service, _, method = r.path[1:].partition("/")
        a["rpc.system"] = "grpc"
        a["rpc.service"] = service
        a["rpc.method"] = method
        a["rpc.grpc.status_code"] = r.grpc_status if r.grpc_status is not None else 2
    else:
        a["http.request.method"] = r.method
        a["url.path"] = r.path
        a["url.scheme"] = "http"
        a["network.protocol.version"] = "1.1"
        if r.http_status:
            a["http.response.status_code"] = r.http_status
        if r.authority:
            a["server.address"] = r.authority.rpartition(":")[0] or r.authority
        a["http.request.body.size"] = r.bytes_in
        a["http.response.body.size"] = r.bytes_out
    # GenAI semantic conventions, where the body phase and the response told us.
    if r.model:
        a["gen_ai.request.model"] = r.model
    if r.max_tokens is not None:
        a["gen_ai.request.max_tokens"] = r.max_tokens
    if r.input_tokens is not None:
        a["gen_ai.usage.input_tokens"] = r.input_tokens
    if r.output_tokens is not None:
        a["gen_ai.usage.output_tokens"] = r.output_tokens
    if r.first_token_at is not None:
        a["gen_ai.server.time_to_first_token"] = r.first_token_at - r.anchor
    if r.queue_wait is not None:
        a["sluice.admission.queue_wait_ms"] = round(r.queue_wait * 1000, 3)
    if r.priority is not None:
        a["sluice.priority"] = r.priority
    if r.stream:
        a["sluice.stream"] = True
        a["sluice.stream.events"] = r.stream_events
    return a
