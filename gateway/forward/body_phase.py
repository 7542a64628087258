"""(compiled) The body phase of an HTTP request: the body as the filters' `on_body` sees it.

A JSON body read whole is parsed (`gateway.core.body.from_doc`: model, max_tokens, the prompt's
size); anything else is opaque (sizes only). A request without a body skips the phase when no
filter reads one (`Chain.body_when_empty`); `ctx.body` stays None then.
"""

from __future__ import annotations

from gateway import jsonfast
from gateway.context import RequestContext, Status
from gateway.core import body as bodies
from gateway.core.verdict import Verdict
from gateway.filters.chain import Chain


def body_phase(
    ctx: RequestContext, chain: Chain, body: bytes | object, length: int | None
) -> Verdict | None:
    """Show the body to `on_body`: None to go on, else the verdict of the filter that stopped."""
    if isinstance(body, bytes):
        rb = None
        if body and jsonfast.is_json_type(ctx.info.headers.get("content-type")):
            try:
                rb = bodies.from_doc(body, jsonfast.loads(body))
            except (ValueError, RecursionError):
                pass  # malformed JSON passes through unchanged
        if rb is None:
            rb = bodies.opaque(len(body), body)
    elif body is None and not chain.body_when_empty:
        return None  # no body, and no filter that reads a request without one
    else:  # streamed (larger than the buffer cap) or absent: sizes only
        rb = bodies.opaque(length or 0)
    ctx.body = rb
    if chain.on_body(ctx, rb) is Status.STOP:
        return ctx.verdict
    return None
