"""The response phase is shown to a token rule (and parsed for it) only for requests that
reserved tokens; a filter with on_event that did not say `events_when_asked` sees every answer;
an event of a kind no filter reads (`event_kinds`) is not made; a request without a body has
no body phase when no filter reads one (`body_when_empty`)."""

from __future__ import annotations

import json
from typing import Any

from gateway.context import EventKind, RequestContext, Status, StreamEvent
from gateway.core import body as bodies
from gateway.core.request import RequestInfo, Wire
from gateway.filters.chain import Chain
from gateway.filters.registry import build_chain
from gateway.policy.compiled import CompiledPolicy, compile_policy
from gateway.policy.model import Policy
from gateway.services import Services

DOC: dict[str, Any] = {
    "backends": [{"name": "vllm", "endpoints": [{"address": "127.0.0.1:9"}]}],
    "routes": [{"name": "openai", "backend": "vllm"}],
    "filters": ["ratelimit", "route"],
    "rate_limits": {
        "rules": [{"name": "tok", "key": ["header:x-tenant"], "tokens_per_second": 1e6}]
    },
}


def policy() -> CompiledPolicy:
    return compile_policy(Policy.model_validate(DOC))


def request(chain: Chain, pol: CompiledPolicy, method: str, body: bytes) -> RequestContext:
    info = RequestInfo(Wire.HTTP, method, "/v1/chat/completions", {"x-tenant": "a"}, "10.0.0.1")
    ctx = RequestContext(info, pol)
    assert chain.run_request(ctx) is Status.CONTINUE
    rb = bodies.from_doc(body, json.loads(body)) if body else bodies.opaque(0)
    ctx.body = rb
    assert chain.on_body(ctx, rb) is Status.CONTINUE
    return ctx


async def test_only_a_request_that_reserved_tokens_asks_for_the_response_phase() -> None:
    pol = policy()
    chain = build_chain(pol, Services())
    chain.activate()
    assert chain.has_events and not chain.events_always
    get = request(chain, pol, "GET", b"")
    assert get.reservation is None or get.reservation.tokens is None
    assert not chain.listens(get)  # GET /v1/models: its answer is not parsed for the rule
    post = request(chain, pol, "POST", b'{"model": "m", "max_tokens": 16, "messages": []}')
    assert post.reservation.tokens is not None
    assert chain.listens(post)
    chain.on_response_plain(get)
    chain.on_response_plain(post)


class EveryAnswer:
    name = "every"

    def __init__(self) -> None:
        self.seen: list[EventKind] = []

    def on_event(self, ctx: RequestContext, event: StreamEvent) -> Status:
        self.seen.append(event.kind)
        return Status.CONTINUE


async def test_a_filter_that_did_not_opt_in_sees_every_answer() -> None:
    pol = policy()
    every = EveryAnswer()
    chain = Chain([*build_chain(pol, Services()).filters, every])
    assert chain.events_always
    ctx = request(chain, pol, "GET", b"")
    assert chain.listens(ctx)
    head = StreamEvent(EventKind.HEAD, 200, raw_headers=[(b"Content-Type", b"text/plain")])
    chain.on_event(ctx, head)
    assert every.seen == [EventKind.HEAD]
    assert head.metadata == (("content-type", "text/plain"),)  # decoded when read


async def test_a_token_rule_reads_no_head_or_json_event_but_gets_the_usage() -> None:
    from gateway.forward import relay

    pol = policy()
    every = EveryAnswer()
    chain = build_chain(pol, Services())
    assert chain.heard == {EventKind.SSE, EventKind.TRAILERS}
    post = request(chain, pol, "POST", b'{"model": "m", "max_tokens": 16, "messages": []}')
    assert chain.listens(post)
    answer = b'{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}'
    assert relay.on_head(post, chain, 200, []) is Status.CONTINUE
    assert relay.on_json(post, chain, 200, answer) is Status.CONTINUE
    assert post.usage == bodies.Usage(3, 5)
    # A filter that says nothing of the kinds it reads reads them all.
    chain = Chain([*chain.filters, every])
    assert chain.heard == set(EventKind)
    assert relay.on_head(post, chain, 200, []) is Status.CONTINUE
    assert relay.on_json(post, chain, 200, answer) is Status.CONTINUE
    assert every.seen == [EventKind.HEAD, EventKind.JSON]


async def test_a_request_without_a_body_has_no_body_phase_unless_a_filter_reads_it() -> None:
    from gateway.forward.body_phase import body_phase

    pol = policy()
    chain = build_chain(pol, Services())
    chain.activate()
    assert chain.has_body and not chain.body_when_empty  # the token rule: nothing to reserve
    info = RequestInfo(Wire.HTTP, "GET", "/v1/models", {"x-tenant": "a"}, "10.0.0.1")
    ctx = RequestContext(info, pol)
    assert chain.run_request(ctx) is Status.CONTINUE
    assert body_phase(ctx, chain, None, None) is None
    assert ctx.body is None and ctx.reservation.tokens is None and not chain.listens(ctx)
    # A body that is there, even empty, is shown.
    assert body_phase(ctx, chain, b"", None) is None
    assert ctx.body is not None and ctx.body.size == 0
    # A model-keyed rule decides in the body phase, a body or not.
    doc = {**DOC, "rate_limits": {"rules": [{"name": "m", "key": ["model"], "qps": 1e6}]}}
    pol = compile_policy(Policy.model_validate(doc))
    chain = build_chain(pol, Services())
    assert chain.body_when_empty
    # So is any filter that does not say.
    assert Chain([EveryBody()]).body_when_empty


class EveryBody:
    name = "every-body"

    def on_body(self, ctx: RequestContext, body: bodies.RequestBody) -> Status:
        return Status.CONTINUE
