"""The trace filter, the tracing owner and the real SDK/OTLP pipeline, in one process, against a
real OTLP/gRPC receiver: the request path is driven by hand (as the forwarding path drives it),
so every recorded fact (body, usage, tries, stream events, decisions) is checked in the spans."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.context import RequestContext
from gateway.core.body import Usage, from_doc
from gateway.core.outcome import Outcome
from gateway.core.request import RequestInfo, Wire
from gateway.core.sampler import ONE
from gateway.core.traceparent import client_span_id, parse
from gateway.filters.registry import build_chain
from gateway.filters.trace import TraceFilter
from gateway.policy.compiled import compile_policy
from gateway.policy.model import Policy
from gateway.services import Services
from gateway.telemetry.tracing import TRACING, Tracing
from tests.telemetry.otlp import CLIENT, SERVER, STATUS_ERROR, HttpReceiver, Receiver, Span


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with Receiver() as rx:
        yield rx


def policy(rx: Receiver, **tracing: Any) -> Any:
    doc = {
        "access_log": {"enabled": False},
        "backends": [
            {"name": "vllm", "endpoints": [{"address": "127.0.0.1:9"}]},
            {"name": "triton", "protocol": "grpc", "endpoints": [{"address": "127.0.0.1:10"}]},
        ],
        "routes": [
            {"name": "grpc", "match": {"protocol": "grpc"}, "backend": "triton"},
            {"name": "openai", "match": {"path_prefix": "/v1/"}, "backend": "vllm"},
        ],
        "tracing": {
            "enabled": True,
            "sample_ratio": 0.0,
            "slow_ms": 500,
            "service_name": "sluice-edge",
            "max_wait_ms": 20,
            "exporter": {"protocol": "grpc", "endpoint": f"http://127.0.0.1:{rx.port}"},
            **tracing,
        },
    }
    return compile_policy(Policy.model_validate(doc))


async def spans_of(rx: Receiver, trace_id: int, n: int, timeout: float = 30.0) -> list[Span]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = rx.traces().get(trace_id, [])
        if len(got) >= n:
            await asyncio.sleep(0.1)  # nothing more may come for it
            return rx.traces()[trace_id]
        await asyncio.sleep(0.05)
    return rx.traces().get(trace_id, [])


PARENT = 0x00F067AA0BA902B7
TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736  # low 64 bits far above any small ratio


def request(path: str, proto: Wire = Wire.HTTP, trace: int = TRACE) -> RequestInfo:
    headers = {"traceparent": f"00-{trace:032x}-{PARENT:016x}-01", "tracestate": "vendor=x"}
    return RequestInfo(proto, "POST", path, headers, peer="10.0.0.7:51234", authority="edge:8080")


async def test_a_failed_stream_with_a_retry_arrives_complete(receiver: Receiver) -> None:
    services = Services()
    compiled = policy(receiver)
    chain = build_chain(compiled, services)
    chain.activate()
    try:
        ctx = RequestContext(request("/v1/chat/completions"), compiled)
        await chain.on_request(ctx)
        assert ctx.trace_id == TRACE and ctx.parent_span_id == PARENT
        first_tp = parse(ctx.upstream_headers["traceparent"])
        assert first_tp == (TRACE, client_span_id(ctx.span_id, 0), 0)  # ratio 0: not sampled
        ctx.body = from_doc(b"{}", {"model": "llama-3-8b", "max_tokens": 64, "stream": True})
        ctx.decide("auth", "auth.ok", "provider=corp")
        ctx.decide("ratelimit", "limit.allow", "colour=green")
        t0 = time.monotonic()
        ctx.begin_try("vllm", "127.0.0.1:9", t0)  # the first try fails to connect
        ctx.end_try(t0 + 0.001, 0, Outcome.UPSTREAM_CONNECT.value)
        ctx.decide("forward", "retry", "connect refused")
        ctx.begin_try("vllm", "127.0.0.1:9", t0 + 0.002)
        assert parse(ctx.upstream_headers["traceparent"]) == (
            TRACE,
            client_span_id(ctx.span_id, 1),
            0,
        )
        ctx.try_first_byte(t0 + 0.010, 200)
        ctx.http_status = 200
        for k in range(5):
            ctx.stream_event(t0 + 0.020 + k * 0.005)
        ctx.usage = Usage(prompt_tokens=12, completion_tokens=5)
        ctx.outcome = Outcome.UPSTREAM_PROTOCOL  # the stream broke at the end
        ctx.end_try(t0 + 0.050, 0, Outcome.UPSTREAM_PROTOCOL.value)
        await asyncio.sleep(0.06)  # the request ends after its last try
        await chain.on_response(ctx)
        assert ctx.trace_kept

        spans = await spans_of(receiver, TRACE, 3)
        assert len(spans) == 3
        server = next(s for s in spans if s.kind == SERVER)
        clients = sorted((s for s in spans if s.kind == CLIENT), key=lambda s: s.start_ns)
        assert server.span_id == ctx.span_id and server.parent_span_id == PARENT
        assert [c.parent_span_id for c in clients] == [ctx.span_id, ctx.span_id]
        assert [c.span_id for c in clients] == [client_span_id(ctx.span_id, i) for i in (0, 1)]
        assert server.service == "sluice-edge"
        assert server.name == "POST openai"
        assert server.status_code == STATUS_ERROR
        a = server.attributes
        assert a["gen_ai.request.model"] == "llama-3-8b"
        assert a["gen_ai.request.max_tokens"] == 64
        assert a["gen_ai.usage.input_tokens"] == 12
        assert a["gen_ai.usage.output_tokens"] == 5
        assert a["gen_ai.server.time_to_first_token"] > 0
        assert a["http.request.method"] == "POST" and a["http.response.status_code"] == 200
        assert a["sluice.sampling.reason"] == "error"
        assert a["error.type"] == "upstream_protocol_error"
        assert a["sluice.attempts"] == 2 and a["sluice.backend"] == "vllm"
        assert server.events == ["auth.ok", "limit.allow", "retry", "first_token"]
        assert clients[0].attributes["error.type"] == "upstream_connect_error"
        assert clients[1].attributes["http.response.status_code"] == 200
        assert clients[1].events == ["first_byte"]
        assert server.start_ns <= clients[0].start_ns < clients[1].start_ns
        assert clients[1].end_ns <= server.end_ns
    finally:
        await services.aclose()


async def test_grpc_rejection_and_ratio_keep(receiver: Receiver) -> None:
    services = Services()
    compiled = policy(receiver, sample_ratio=0.5)
    chain = build_chain(compiled, services)
    chain.activate()
    try:
        # A gRPC call refused by Sluice (as a limiter would shed it): kept, one server span.
        shed = TRACE ^ 1
        ctx = RequestContext(request("/pkg.Svc/Infer", Wire.GRPC, shed), compiled)
        await chain.on_request(ctx)
        from gateway.core.verdict import GRPC_RESOURCE_EXHAUSTED, reject

        ctx.stop(reject(429, GRPC_RESOURCE_EXHAUSTED, "rate_limited", "slow down", 1.0))
        ctx.grpc_status = GRPC_RESOURCE_EXHAUSTED
        await chain.on_response(ctx)
        # An OK call whose trace id falls under the ratio: kept with its adjusted count.
        lucky = (0xABC << 64) | 1
        ok = RequestContext(request("/pkg.Svc/Infer", Wire.GRPC, lucky), compiled)
        await chain.on_request(ok)
        assert ok.upstream_headers["traceparent"].endswith("-01")  # sampled flag: the ratio
        ok.begin_try("triton", "127.0.0.1:10", time.monotonic())
        ok.grpc_status = 0
        ok.end_try(time.monotonic(), 0)
        await chain.on_response(ok)

        (s,) = await spans_of(receiver, shed, 1)
        assert s.name == "pkg.Svc/Infer" and s.kind == SERVER
        assert s.attributes["rpc.system"] == "grpc"
        assert s.attributes["rpc.grpc.status_code"] == GRPC_RESOURCE_EXHAUSTED
        assert s.attributes["sluice.sampling.reason"] == "rejected"
        assert s.attributes["sluice.rejected"] == "rate_limited"
        spans = await spans_of(receiver, lucky, 2)
        server = next(x for x in spans if x.kind == SERVER)
        assert server.attributes["sluice.sampling.reason"] == "ratio"
        assert server.attributes["sampling.adjusted_count"] == pytest.approx(2.0)
        assert server.status_code != STATUS_ERROR
    finally:
        await services.aclose()


async def test_a_later_request_of_a_kept_trace_joins_it(receiver: Receiver) -> None:
    services = Services()
    compiled = policy(receiver, max_wait_ms=2000)
    chain = build_chain(compiled, services)
    chain.activate()
    trace = TRACE ^ 2
    try:
        failed = RequestContext(request("/v1/completions", trace=trace), compiled)
        await chain.on_request(failed)
        failed.http_status = 503
        await chain.on_response(failed)
        retry = RequestContext(request("/v1/completions", trace=trace), compiled)
        await chain.on_request(retry)
        retry.http_status = 200
        await chain.on_response(retry)
        spans = await spans_of(receiver, trace, 2)
        reasons = sorted(s.attributes["sluice.sampling.reason"] for s in spans)
        assert reasons == ["error", "linked"]
    finally:
        await services.aclose()


async def test_dropped_requests_leave_nothing_pending(receiver: Receiver) -> None:
    services = Services()
    compiled = policy(receiver)
    chain = build_chain(compiled, services)
    chain.activate()
    try:
        owner = services.peek(TRACING)
        assert isinstance(owner, Tracing)
        for i in range(200):
            ctx = RequestContext(request("/v1/x", trace=(i + 7) << 64 | (ONE - 1)), compiled)
            await chain.on_request(ctx)
            ctx.http_status = 200
            await chain.on_response(ctx)
            assert not ctx.trace_kept
        assert len(owner.pending) == 0
    finally:
        await services.aclose()


async def test_reload_keeps_the_owner_and_what_is_pending(receiver: Receiver) -> None:
    services = Services()
    first = policy(receiver, max_wait_ms=60_000)
    chain = build_chain(first, services)
    chain.activate()
    try:
        owner = services.peek(TRACING)
        assert isinstance(owner, Tracing)
        for i in range(5):
            ctx = RequestContext(request("/v1/x", trace=TRACE + 100 + i), first)
            await chain.on_request(ctx)
            ctx.http_status = 500
            await chain.on_response(ctx)
        assert len(owner.pending) == 5
        pipeline = owner.pipeline
        second = policy(receiver, max_wait_ms=60_000, max_pending_traces=3, slow_ms=100)
        chain2 = build_chain(second, services)
        chain2.activate()
        assert services.peek(TRACING) is owner
        assert owner.pipeline is pipeline  # same exporter settings: same pipeline
        assert len(owner.pending) == 3 and owner.pending.dropped_traces == 2
        trace_filter = next(f for f in chain2.filters if isinstance(f, TraceFilter))
        assert trace_filter.sampler.slow_s == pytest.approx(0.1)
        third = policy(receiver, max_wait_ms=60_000, service_name="other")
        build_chain(third, services).activate()
        assert owner.pipeline is not pipeline  # new exporter settings: new pipeline
        # The traces pending under the old pipeline were exported by it, not lost.
        got = await spans_of(receiver, TRACE + 104, 1)
        assert got and got[0].service == "sluice-edge"
    finally:
        await services.aclose()


def test_tracing_off_builds_no_filter(receiver: Receiver) -> None:
    services = Services()
    compiled = policy(receiver, enabled=False)
    chain = build_chain(compiled, services)
    assert not any(isinstance(f, TraceFilter) for f in chain.filters)
    assert services.peek(TRACING) is None


async def test_otlp_over_http(receiver: Receiver) -> None:
    with HttpReceiver() as hrx:
        exporter = {
            "protocol": "http/protobuf",
            "endpoint": f"http://127.0.0.1:{hrx.port}/v1/traces",
        }
        services = Services()
        compiled = policy(receiver, exporter=exporter)
        chain = build_chain(compiled, services)
        chain.activate()
        trace = TRACE ^ 3
        try:
            ctx = RequestContext(request("/v1/chat/completions", trace=trace), compiled)
            await chain.on_request(ctx)
            ctx.begin_try("vllm", "127.0.0.1:9", time.monotonic())
            ctx.http_status = 502
            ctx.outcome = Outcome.UPSTREAM_CONNECT
            ctx.end_try(time.monotonic(), 0, Outcome.UPSTREAM_CONNECT.value)
            await chain.on_response(ctx)
            spans = await spans_of(hrx, trace, 2)
            assert {s.kind for s in spans} == {SERVER, CLIENT}
            assert hrx.requests >= 1
        finally:
            await services.aclose()
