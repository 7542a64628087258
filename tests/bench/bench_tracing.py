"""Tracing costs, in process: `python -m tests.bench.bench_tracing`.

1. CPU per request of the trace filter (on_request + on_response) for an OK request the tail
   sampler drops, with and without an incoming traceparent, against the same request with no
   trace filter; and for a kept (error) request, the record and the offer.
2. CPU per kept trace of building its SDK spans (server + one client span) off the request path.
3. Memory of the pending buffer at its configured bounds (max_pending_traces records of one
   request each; and the worst case: every trace full at max_spans_per_trace).
"""

from __future__ import annotations

import asyncio
import gc
import time
import tracemalloc

from gateway.context import RequestContext
from gateway.core.body import Usage, from_doc
from gateway.core.outcome import Outcome
from gateway.core.request import RequestInfo, Wire
from gateway.filters.trace import TraceFilter
from gateway.policy.compiled import compile_policy
from gateway.policy.model import Policy
from gateway.services import Services
from gateway.telemetry.spans import record_of
from gateway.telemetry.tracing import TRACING, Pipeline, Tracing

N = 200_000
DOC = {
    "backends": [{"name": "vllm", "endpoints": [{"address": "127.0.0.1:9"}]}],
    "routes": [{"name": "openai", "backend": "vllm"}],
    "tracing": {"enabled": True, "exporter": {"endpoint": "http://127.0.0.1:9/v1/traces"}},
}
POLICY = compile_policy(Policy.model_validate(DOC))
ROUTE = POLICY.routes[0]
HEADERS = {"host": "edge", "content-type": "application/json", "user-agent": "bench"}
TP = {**HEADERS, "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


def per_request(f: TraceFilter | None, headers: dict[str, str], status: int = 200) -> float:
    info = RequestInfo(Wire.HTTP, "POST", "/v1/chat/completions", headers, "10.0.0.1:5")
    gc.collect()
    gc.disable()
    t0 = time.process_time()
    for _ in range(N):
        ctx = RequestContext(info, POLICY)
        ctx.route = ROUTE
        if f is not None:
            f.on_request(ctx)
        ctx.http_status = status
        if f is not None:
            f.on_response(ctx)
        if ctx.trace_kept:
            f.owner.pending.drain()  # type: ignore[union-attr]
    t = time.process_time() - t0
    gc.enable()
    return t / N * 1e6


def kept_ctx(i: int) -> RequestContext:
    info = RequestInfo(Wire.HTTP, "POST", "/v1/chat/completions", TP, "10.0.0.1:5")
    ctx = RequestContext(info, POLICY)
    ctx.trace_id, ctx.span_id, ctx.parent_span_id = (i + 1) << 64 | 7, i + 1, 9
    ctx.route, ctx.endpoint = ROUTE, ROUTE.endpoints[0]
    ctx.request_id = f"{i:032x}"
    ctx.body = from_doc(b"{}", {"model": "llama-3-8b", "max_tokens": 64})
    ctx.usage = Usage(12, 64)
    for name in ("auth.ok", "limit.allow", "route.pick", "breaker.closed"):
        ctx.decide("x", name, "detail")
    now = time.monotonic()
    ctx.begin_try("vllm", "127.0.0.1:9", now)
    ctx.try_first_byte(now, 500)
    ctx.end_try(now, 0, "upstream_error")
    ctx.http_status, ctx.outcome = 500, Outcome.UPSTREAM_ERROR
    return ctx


def memory(max_traces: int, records_per_trace: int) -> int:
    """Bytes the full pending buffer keeps alive (the contexts themselves are gone)."""
    owner = Tracing(Services())
    owner.pending.resize(max_traces, 2 * records_per_trace, 60.0)
    section = Policy.model_validate(DOC).tracing
    d = TraceFilter(section, owner).sampler.decide(1, Outcome.UPSTREAM_ERROR, False, 500, None, 0)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(max_traces):
        for _ in range(records_per_trace):
            ctx = kept_ctx(i)
            owner.pending.offer(ctx.trace_id, record_of(ctx, d, time.monotonic(), 64), 2, 0.0)
            del ctx
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(owner.pending) == max_traces
    return used


def build_cost() -> float:
    pipeline = Pipeline("bench", Policy.model_validate(DOC).tracing.exporter)
    pipeline.max_queue = 10**9
    pipeline.processor.on_end = lambda span: None  # type: ignore[method-assign]
    owner = Tracing(Services())
    sampler = TraceFilter(Policy.model_validate(DOC).tracing, owner).sampler
    dec = sampler.decide(1, Outcome.UPSTREAM_ERROR, False, 500, None, 0.01)
    records = [record_of(kept_ctx(i), dec, time.monotonic(), 64) for i in range(20_000)]
    t0 = time.process_time()
    for r in records:
        pipeline.emit(r)
    t = time.process_time() - t0
    pipeline.provider.shutdown()
    return t / len(records) * 1e6


async def main() -> None:
    services = Services()
    section = Policy.model_validate(DOC).tracing
    owner = services.get(TRACING, lambda: Tracing(services))
    f = TraceFilter(section, owner)
    base = min(per_request(None, HEADERS) for _ in range(3))
    fresh = min(per_request(f, HEADERS) for _ in range(3))
    incoming = min(per_request(f, TP) for _ in range(3))
    kept = min(per_request(f, TP, 500) for _ in range(3))
    print(f"context only (no trace filter)          {base:6.2f} µs/request")
    print(f"trace filter, OK dropped, new trace     {fresh - base:6.2f} µs/request over that")
    print(f"trace filter, OK dropped, traceparent   {incoming - base:6.2f} µs/request over that")
    print(f"trace filter, error kept (record+offer) {kept - base:6.2f} µs/request over that")
    print(f"SDK spans of a kept trace (2 spans)     {build_cost():6.2f} µs/trace, off the path")
    for traces, per in ((1000, 1), (1000, 32)):
        b = memory(traces, per)
        print(
            f"pending buffer: {traces} traces x {per} request(s) ({traces * per * 2} spans): "
            f"{b / 1024 / 1024:6.2f} MiB ({b / (traces * per):,.0f} B/request)"
        )
    await services.aclose()


if __name__ == "__main__":
    asyncio.run(main())
