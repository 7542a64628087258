"""(compiled) The body phase of an HTTP request: the body as the filters' `on_body` sees it.

A JSON body read whole is parsed as its API family reads it (`gateway.core.body.from_doc` for
chat and text completions: model, max_tokens, the prompt's size; `gateway.core.apis.read` for
embeddings, Responses and Messages); anything else is opaque (sizes only). A request without a
body skips the phase when no filter reads one (`Chain.body_when_empty`); `ctx.body` stays None then.
"""

from __future__ import annotations

from gateway import jsonfast
from gateway.context import RequestContext, Status
from gateway.core import apis
from gateway.core import body as bodies
from gateway.core.verdict import Verdict
from gateway.filters.chain import Chain


def body_phase(
    ctx: RequestContext, chain: Chain, body: bytes | object, length: int | None
) -> Verdict | None:
    """Show the body to `on_body`: None to go on, else the verdict of the filter that stopped."""
    route = ctx.route
    api = apis.resolve(route.api if route is not None else None, ctx.info.path)
    if isinstance(body, bytes):
        rb = None
        if body and bodies.is_json_type(ctx.info.headers.get("content-type")):
            try:
                doc = jsonfast.loads(body)
                if api == apis.CHAT or api == apis.COMPLETIONS:
                    rb = bodies.from_doc(body, doc)
                else:
                    rb = apis.read(api, body, doc)
            except (ValueError, RecursionError):
                pass  # malformed JSON passes through unchanged
        if rb is None:
            rb = bodies.opaque(len(body), body)
    elif body is None and not chain.body_when_empty:
        return None  # no body, and no filter that reads a request without one
    else:  # streamed (larger than the buffer cap) or absent: sizes only
        rb = bodies.opaque(length or 0)
    if rb.api != api:
        rb.api = api
    ctx.body = rb
    if chain.on_body(ctx, rb) is Status.STOP:
        return ctx.verdict
    return None


def api_of(ctx: RequestContext) -> str:
    """The request's API family (`gateway.core.apis`): its body's, else its route's or path's."""
    b = ctx.body
    if b is not None:
        return b.api
    route = ctx.route
    return apis.resolve(route.api if route is not None else None, ctx.info.path)
