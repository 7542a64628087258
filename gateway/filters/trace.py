"""(compiled) Trace filter: W3C trace context in and out, the tail-sampling decision when the
request ends.

`on_request` takes the trace id and parent span of a valid incoming `traceparent` (HTTP header
or gRPC metadata, the same map), else starts a trace, picks the server span id, and sets the
`traceparent` sent upstream (same trace id; parent = the first try's client span; sampled flag =
the ratio test, so a backend that samples by parent keeps the same traces). `tracestate` passes
through with the client's other headers.

`on_response` decides (`gateway.core.sampler.TailSampler`), counts the decision by reason, and
for a kept trace only copies a small record into the tracing owner's pending buffer; SDK spans
are built later, off the request path (`gateway.telemetry.tracing`). Budget: ≤ 5 µs per OK
request over tracing off. Requests refused before the chain runs (431, unsafe path) are not
traced; everything the chain saw is.
"""

from __future__ import annotations

import os
import random
import time
from typing import Final

from gateway.context import RequestContext, Status, StreamEvent
from gateway.core.body import RequestBody
from gateway.core.sampler import Reason, TailSampler
from gateway.core.traceparent import MASK64, client_span_id
from gateway.core.traceparent import parse as parse_traceparent
from gateway.core.verdict import ALLOW
from gateway.policy.model import Tracing as TracingSection
from gateway.services import Services
from gateway.telemetry import metrics
from gateway.telemetry.requests import counter_tally
from gateway.telemetry.spans import record_of
from gateway.telemetry.tracing import TRACING, Tracing

_monotonic: Final = time.monotonic  # a static: no module attribute lookup per call

# Trace and span ids must be unique, not secret (W3C: random is enough): a per-process PRNG
# seeded from the OS, as for request ids, saves a syscall per request.
_getrandbits: Final = random.Random(os.urandom(32)).getrandbits


class TraceFilter:
    name = "trace"

    def __init__(self, section: TracingSection, owner: Tracing) -> None:
        self.section = section
        self.owner = owner
        self.sampler = TailSampler(
            section.sample_ratio, section.slow_ms / 1000, section.error_status
        )
        self._threshold = self.sampler.threshold
        self._max_spans = section.max_spans_per_trace
        # Plain-number tallies (flushed at scrape), by the member's id: no lock, no enum hash.
        self._counters = {id(r): counter_tally(metrics.TRACE_DECISIONS, r.value) for r in Reason}
        # The pending traces by id (one object for the owner's life): `in` on it is a C call,
        # where `in owner.pending` would be a Python-level `__contains__`.
        self._pending_ids = owner.pending.ids

    def activate(self) -> None:
        self.owner.configure(self.section)

    def on_request(self, ctx: RequestContext) -> Status:
        tp = ctx.info.headers.get("traceparent")
        parsed = parse_traceparent(tp) if tp is not None else None
        if parsed is not None:
            trace_id, ctx.parent_span_id, ctx.trace_flags = parsed
        else:
            trace_id = _getrandbits(128) or 1
        ctx.trace_id = trace_id
        span = ctx.span_id = _getrandbits(64) or 1
        flag = "-01" if (trace_id & MASK64) < self._threshold else "-00"
        # (bytes.hex: a third of what formatting a 128-bit int with `:032x` costs)
        tid = trace_id.to_bytes(16, "big").hex()
        sid = client_span_id(span, 0).to_bytes(8, "big").hex()
        ctx.upstream_headers["traceparent"] = f"00-{tid}-{sid}{flag}"  # (one string built)
        return Status.CONTINUE

    def on_response(self, ctx: RequestContext) -> None:
        now = ctx.ended or _monotonic()
        owner = self.owner
        trace_id = ctx.trace_id
        verdict = ctx.verdict
        d = self.sampler.decide(
            trace_id,
            ctx.outcome,
            verdict is not ALLOW and not verdict.allowed,  # (a property: a call; ALLOW is common)
            ctx.http_status,
            ctx.grpc_status,
            now - ctx.started,
            trace_id in self._pending_ids,
        )
        self._counters[id(d.reason)].inc()
        if d.keep:
            ctx.trace_kept = True
            owner.offer(record_of(ctx, d, now, self._max_spans), now)


class GenAITraceFilter(TraceFilter):
    """`tracing.genai_attributes`: the same filter, plus the two hooks whose mere presence
    makes the forwarding path parse the request body (model, max_tokens) and the response
    (usage) for it. They decide nothing."""

    def on_body(self, ctx: RequestContext, body: RequestBody) -> Status:
        return Status.CONTINUE

    def on_event(self, ctx: RequestContext, event: StreamEvent) -> Status:
        return Status.CONTINUE


def build(section: TracingSection, services: Services) -> TraceFilter | None:
    if not section.enabled:
        return None
    owner = services.get(TRACING, lambda: Tracing(services))
    cls = GenAITraceFilter if section.genai_attributes else TraceFilter
    return cls(section, owner)
