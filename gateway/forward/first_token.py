"""(compiled) Holding a streamed answer until its first token (`retries.before_first_token`), so
that a backend failing first can be retried on another member and the client sees one clean stream.

`hold` reads an SSE response ahead, after its head, until the first event with content
(`gateway.core.first_token`), the end of the stream, or `HOLD_BYTES` held (then it goes out as
it is: a long preamble is not a failure); what it read is put back into the response
(`UpstreamResponse.hold`) for the relay. It answers why the try failed before any content:
the connection reset or broke (`reset`), an SSE error event (`error_event`), or no content
within the hold time (`stall`, the route's `timeouts.first_byte_s`). Nothing of the answer has
reached the client then: the forwarding path may retry it (`gateway.forward.http`), and once
content reached the client it never does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Final

from gateway.core.first_token import Seen, classify
from gateway.core.outcome import Outcome
from gateway.core.sse import SseParser
from gateway.errors import UpstreamError, UpstreamProtocolError, UpstreamTimeout
from gateway.forward.headers import request_headers
from gateway.forward.lifecycle import retry
from gateway.telemetry import metrics

if TYPE_CHECKING:
    from gateway.context import RequestContext
    from gateway.forward.exchange import Exchange
    from gateway.policy.compiled import RouteTimeouts
    from gateway.snapshot import Snapshot
    from gateway.upstream.response import UpstreamResponse

_monotonic: Final = time.monotonic  # a static: no module attribute lookup per call


# The forwarder's upstream call with its retries (`gateway.forward.http.HttpForward.tries`).
Tries = Callable[
    [
        "RequestContext",
        "Exchange",
        str,
        str,
        list[tuple[bytes, bytes]],
        "bytes | None",
        "RouteTimeouts",
    ],
    Awaitable["UpstreamResponse"],
]


HOLD_BYTES: Final = 64 * 1024
RESET, ERROR_EVENT, STALL, HTTP_5XX = "reset", "error_event", "stall", "http_5xx"

# What each failure before content is, for the try's record and the retry rule.
OUTCOMES: Final = {
    RESET: Outcome.UPSTREAM_PROTOCOL,
    ERROR_EVENT: Outcome.UPSTREAM_ERROR,
    STALL: Outcome.UPSTREAM_TIMEOUT,
    HTTP_5XX: Outcome.UPSTREAM_ERROR,
}
_SSE: Final = b"text/event-stream"


def is_sse(up: UpstreamResponse) -> bool:
    for n, v in up.headers:
        if n.lower() == b"content-type":
            return v.lower().startswith(_SSE)
    return False


async def hold(up: UpstreamResponse, hold_s: float, max_event: int) -> str | None:
    """Read ahead to the first content (see the module docstring). None: content came, the
    stream ended, or too much preamble; else the failure's kind."""
    parser = SseParser(max_event)
    held: list[bytes] = []
    size = 0
    failure: str | None = None
    try:
        async with asyncio.timeout(hold_s):
            while size <= HOLD_BYTES and not parser.overflowed:
                chunk = await up.read_chunk()
                if not chunk:
                    break  # ended before any content: passed on as the backend sent it
                held.append(chunk)
                size += len(chunk)
                seen = [classify(ev) for ev in parser.feed(chunk)]
                if Seen.ERROR in seen:
                    failure = ERROR_EVENT
                    break
                if Seen.CONTENT in seen or Seen.END in seen:
                    break
    except TimeoutError:
        failure = STALL
    except UpstreamError:
        failure = RESET
    up.hold(held)
    return failure


async def until_first_token(
    tries: Tries,
    ctx: RequestContext,
    ex: Exchange,
    method: str,
    path: str,
    body: bytes | None,
    up: UpstreamResponse,
    snap: Snapshot,
) -> UpstreamResponse:
    """`retries.before_first_token`: a stream's start is held until its first content
    (`gateway.forward.first_token`); a backend that fails first (5xx, reset, an SSE error
    event, no content within `timeouts.first_byte_s`) is tried again on another member,
    within the route's tries and retry budget. Out of tries, a reset or a stall is answered
    by the failure table, an error event or a 5xx passed on as the backend sent it."""
    route = ctx.route
    assert route is not None
    timeouts = route.timeouts
    max_event = snap.bounds.max_event_bytes
    while True:
        kind = None
        if up.status >= 500:
            kind = HTTP_5XX
        elif is_sse(up):
            t0 = _monotonic()
            kind = await hold(up, timeouts.first_byte_s, max_event)
            ctx.upstream_s += _monotonic() - t0
        if kind is None:
            return up
        status = up.status if kind == HTTP_5XX else 0
        ctx.outcome, ctx.http_status = OUTCOMES[kind], status
        ctx.detail = f"{kind} before the first token"
        nxt = retry(ctx, status, kind)
        if nxt is None:
            if kind == RESET:
                up.discard()
                raise UpstreamProtocolError("upstream reset before the first token")
            if kind == STALL:
                up.discard()
                raise UpstreamTimeout("first token")
            ctx.outcome = Outcome.OK  # passed on as the backend sent it
            return up
        metrics.FIRST_TOKEN_RETRIES.labels(route.name, kind).inc()
        up.discard()
        ctx.begin_try(nxt.backend, nxt.address, _monotonic())
        headers = request_headers(ex.raw_headers, ctx, nxt)
        up = await tries(ctx, ex, method, path, headers, body, timeouts)
