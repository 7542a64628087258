"""What both HTTP ingress engines check before forwarding, in one order: Expect (417), header
bounds (431), path safety (400), the filter chain (its verdict), a route (404), the body bound
(413)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.core.request import unsafe_path
from gateway.filters.base import RequestContext, Status

if TYPE_CHECKING:
    from gateway.snapshot import Snapshot as Active


@dataclass(frozen=True, slots=True)
class Refusal:
    status: int
    kind: str  # the JSON error body's `type`
    message: str
    retry_after: float | None = None


EXPECTATION_FAILED = Refusal(417, "expectation_failed", "only 100-continue is supported")
HEADERS_TOO_LARGE = Refusal(431, "headers_too_large", "request header fields too large")
BAD_PATH = Refusal(400, "bad_path", "path not allowed")
NO_ROUTE = Refusal(404, "no_route", "no route matches")
BODY_TOO_LARGE = Refusal(413, "body_too_large", "body too large")


async def admit(
    ctx: RequestContext, active: Active, header_bytes: int, header_count: int
) -> Refusal | None:
    """None: forward to `ctx.endpoint`. A refusal before the chain leaves `on_response` unrun."""
    limits = active.policy.policy.limits
    expect = ctx.info.headers.get("expect")
    if expect is not None and expect.lower() != "100-continue":
        ctx.ran = 0  # RFC 9110 §10.1.1: an expectation we cannot meet
        return EXPECTATION_FAILED
    if header_bytes > limits.max_header_bytes or header_count > limits.max_header_count:
        ctx.ran = 0  # no filter saw this request: none gets on_response
        return HEADERS_TOO_LARGE
    if unsafe_path(ctx.info.path):
        ctx.ran = 0
        return BAD_PATH
    if await active.chain.on_request(ctx) is Status.STOP:
        v = ctx.verdict
        return Refusal(v.http_status, v.error_type, v.reason, v.retry_after)
    if ctx.route is None or ctx.endpoint is None:
        return NO_ROUTE
    cl = ctx.info.content_length
    if cl is not None and cl > limits.max_body_bytes:
        return BODY_TOO_LARGE
    return None
