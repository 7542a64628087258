"""(compiled) The response phase of an HTTP request: upstream head → client, body relayed chunk by
chunk.

- The head is validated and rebuilt (`headers.client_head`); an invalid one is a 502.
- A body that is complete with its head goes out with it in one write.
- Filters with `on_event` see the HEAD, the JSON body of a non-streaming answer (read whole up to
  `limits.max_event_bytes` before it is sent, so a STOP can still answer with an error), and
  each SSE event, each of the kinds it reads (`event_kinds`: no event is made that no filter
  reads); `ctx.usage` is taken from the family's usage wherever it appears
  (`gateway.core.apis`). SSE is parsed only when someone listens (a filter, or a usage chunk
  to hide that Sluice asked for) or the stream is a Responses or Messages one; then
  whole events are written, so one can be dropped or the stream ended after it.
- A stream that cannot finish (a filter's STOP, the upstream dying or timing out, the total
  deadline) ends cleanly when it is SSE, as its API family defines: an error event and
  `data: [DONE]` (chat, completions), `event: error` (Messages), `error` + `response.failed`
  (Responses), then the normal end of the chunked body. Other bodies are cut (no last-chunk
  marker: the client sees an error, never a complete-looking truncated answer).
- A client that stops reading stalls the writes; past `timeouts.idle_s` without progress the
  request is cut both ways (deadline STALL in `gateway.forward.http`).

`relay` answers what it can itself and returns what is left to the forwarder: a filter's verdict
on a response whose head has not gone out, or the upstream failure (the failure table).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Final

from gateway import jsonfast
from gateway.context import EventKind, RequestContext, Status, StreamEvent
from gateway.core import apis
from gateway.core.body import usage_from, usage_tail
from gateway.core.outcome import Outcome
from gateway.core.sse import SseParser, error_event
from gateway.core.verdict import Verdict
from gateway.errors import UpstreamError, UpstreamProtocolError
from gateway.forward.body_phase import api_of
from gateway.forward.deadlines import STALL, Deadlines
from gateway.forward.headers import BadUpstreamHead, ClientHead, client_head

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gateway.app import Gateway
    from gateway.filters.chain import Chain
    from gateway.forward.exchange import Exchange
    from gateway.snapshot import Snapshot
    from gateway.upstream.response import UpstreamResponse

_monotonic: Final = time.monotonic  # a static: no module attribute lookup per call

_SSE: Final = b"text/event-stream"
_JSON: Final = b"json"


def may_have_body(method: str, status: int) -> bool:
    return method != "HEAD" and status >= 200 and status not in (204, 304)


Ending = Verdict | UpstreamError | None


def relay(
    ex: Exchange,
    ctx: RequestContext,
    snap: Snapshot,
    up: UpstreamResponse,
    task: asyncio.Task[Any],
    deadlines: Deadlines,
    gateway: Gateway,
) -> Ending | Awaitable[Ending]:
    """Relay the upstream response to the client. None: answered here (whole, streamed, or
    ended early). A `Verdict`: a filter refused the response before anything was sent, answer
    it. An `UpstreamError`: the upstream failed (before or after the head went out), answer it
    by the failure table. Answered plainly when the whole answer is here and the engine writes
    without waiting (the common small JSON answer); else an awaitable of the same."""
    status = up.status
    try:
        head = client_head(status, up.headers, ctx)
    except BadUpstreamHead as e:
        up.discard()
        return UpstreamProtocolError(str(e))
    ctx.http_status = status
    if status >= 500:
        ctx.outcome = Outcome.UPSTREAM_ERROR  # passed on as the backend sent it
    chain = snap.chain
    listen = chain.listens(ctx)
    if listen and on_head(ctx, chain, status, up.headers) is Status.STOP:
        return ctx.verdict
    bodied = may_have_body(ctx.info.method, status)
    chunk = up.take()
    if chunk is not None and up.complete:
        json_body = listen and bodied and _JSON in head.content_type
        return _whole(ex, ctx, snap, head, chunk, json_body, bodied, gateway)
    return _relay(ex, ctx, snap, up, task, deadlines, gateway, head, chunk, listen, bodied)


def _whole(
    ex: Exchange,
    ctx: RequestContext,
    snap: Snapshot,
    head: ClientHead,
    chunk: bytes,
    json_body: bool,
    bodied: bool,
    gateway: Gateway,
) -> Verdict | Awaitable[None] | None:
    """The whole answer is `chunk`: its JSON event, then one response."""
    status = ctx.http_status
    if (
        json_body
        and len(chunk) <= snap.bounds.max_event_bytes
        and on_json(ctx, snap.chain, status, chunk) is Status.STOP
    ):
        return ctx.verdict
    ctx.first_byte_at = _monotonic()
    ctx.bytes_out = len(chunk) if bodied else 0
    # HEAD / 204 / 304: no body, but the upstream's Content-Length is announced as is.
    if gateway.draining:
        ex.close_after = True
    length = None if bodied else head.length
    return ex.respond(status, head.lines, chunk if bodied else b"", head.date, length)


async def _relay(
    ex: Exchange,
    ctx: RequestContext,
    snap: Snapshot,
    up: UpstreamResponse,
    task: asyncio.Task[Any],
    deadlines: Deadlines,
    gateway: Gateway,
    head: ClientHead,
    chunk: bytes | None,
    listen: bool,
    bodied: bool,
) -> Ending:
    """`relay` from the first chunk on (`chunk` None: not read yet), when it may wait."""
    status = ctx.http_status
    limits = snap.bounds
    try:
        if chunk is None:
            chunk = await up.read_chunk()
        json_body = listen and bodied and _JSON in head.content_type
        if json_body and not up.complete and (head.length or 0) <= limits.max_event_bytes:
            chunk = await _read_up_to(up, chunk, limits.max_event_bytes)
        if up.complete:
            done = _whole(ex, ctx, snap, head, chunk, json_body, bodied, gateway)
            if done is None or isinstance(done, Verdict):
                return done
            await done
            return None
        length = head.length
        ex.sse = bodied and length is None and head.content_type.startswith(_SSE)
        await ex.send_head(status, head.lines, length, head.date)
        ctx.first_byte_at = _monotonic()
        b = ctx.body
        hide_usage = b is not None and b.usage_added
        if ex.sse:
            api = api_of(ctx)  # Responses and Messages streams are always read: their usage
            typed = api in apis.TYPED_STREAMS  # and first token are in typed events
            if listen or hide_usage or typed:
                await _relay_events(
                    ex, ctx, snap, up, task, deadlines, chunk, listen, hide_usage, typed
                )
                return None
        idle = ctx.route.timeouts.idle_s if ctx.route else 60.0
        sse = ex.sse
        while chunk:
            ctx.bytes_out += len(chunk)
            if sse:  # unparsed SSE: a chunk is (usually) one event
                ctx.stream_event(_monotonic())
            deadlines.tighten(task, idle, STALL)
            await ex.write(chunk)
            deadlines.relax(task)
            chunk = await up.read_chunk()
        await ex.end()
    except UpstreamError as e:
        return e
    return None


def on_head(
    ctx: RequestContext, chain: Chain, status: int, headers: Sequence[tuple[bytes, bytes]]
) -> Status:
    """The answer's head, shown to the listening filters that read heads."""
    if not chain.hears_head:
        return Status.CONTINUE
    return chain.on_event(ctx, StreamEvent(EventKind.HEAD, status, raw_headers=headers))


def on_json(ctx: RequestContext, chain: Chain, status: int, chunk: bytes) -> Status:
    """A complete JSON answer: its `usage` into `ctx.usage`, the parsed answer shown to the
    listening filters that read JSON answers. When only the usage is wanted (no filter reads
    JSON answers; a chat or completions answer), the usage object alone is parsed if the
    answer ends with it (`usage_tail`), as servers write it."""
    b = ctx.body
    openai = b is None or b.api == apis.CHAT or b.api == apis.COMPLETIONS
    if openai and not chain.hears_json:
        u = usage_tail(chunk, _loads)
        if u is not None:
            ctx.usage = u
            return Status.CONTINUE
    doc = _loads(chunk)
    u = usage_from(doc) if b is None or openai else apis.usage_of(b.api, doc, None)
    if u is not None:
        ctx.usage = u
    if not chain.hears_json:
        return Status.CONTINUE  # only the usage was wanted (the token rule)
    return chain.on_event(ctx, StreamEvent(EventKind.JSON, status, chunk, doc))


async def _relay_events(
    ex: Exchange,
    ctx: RequestContext,
    snap: Snapshot,
    up: UpstreamResponse,
    task: asyncio.Task[Any],
    deadlines: Deadlines,
    chunk: bytes,
    listen: bool,
    hide_usage: bool,
    typed: bool,
) -> None:
    """SSE, parsed: whole events are written; one may be dropped (the usage chunk Sluice asked
    for) or the stream ended after it (a filter's STOP). `typed`: a Responses or Messages
    stream (usage and output read from its typed events)."""
    api = api_of(ctx) if typed else apis.CHAT
    chain = snap.chain
    parser = SseParser(snap.bounds.max_event_bytes)
    idle = ctx.route.timeouts.idle_s if ctx.route else 60.0
    while chunk:
        if parser.overflowed:
            out = chunk
        else:
            parts: list[bytes] = []
            for ev in parser.feed(chunk):
                if not ev.data or ev.done:
                    parts.append(ev.raw)
                    continue
                doc = _loads(ev.data)
                u = apis.usage_of(api, doc, ctx.usage) if typed else usage_from(doc)
                if u is not None:
                    ctx.usage = u
                if listen:
                    sev = StreamEvent(EventKind.SSE, 0, ev.data, doc)
                    if chain.on_event(ctx, sev) is Status.STOP:
                        await _write(ex, ctx, task, deadlines, idle, b"".join(parts))
                        v = ctx.verdict
                        ctx.outcome = Outcome.STREAM_CUT
                        await end_early(ex, ctx, v.error_type or "stream_cut", v.reason)
                        return
                if typed:
                    if apis.is_output(doc):
                        ctx.stream_event(_monotonic())  # a token (or a tool call's part)
                elif u is not None and not doc.get("choices"):
                    if hide_usage:
                        continue  # the usage-only chunk the client did not ask for
                else:
                    ctx.stream_event(_monotonic())  # an output event (a token, usually)
                parts.append(ev.raw)
            if parser.overflowed:
                parts.append(parser.take_rest())
            out = b"".join(parts)
        if out:
            await _write(ex, ctx, task, deadlines, idle, out)
        chunk = await up.read_chunk()
    rest = parser.take_rest()
    if rest:
        await _write(ex, ctx, task, deadlines, idle, rest)
    await ex.end()


async def _write(
    ex: Exchange,
    ctx: RequestContext,
    task: asyncio.Task[Any],
    deadlines: Deadlines,
    idle: float,
    data: bytes,
) -> None:
    if not data:
        return
    ctx.bytes_out += len(data)
    deadlines.tighten(task, idle, STALL)
    await ex.write(data)
    deadlines.relax(task)


async def end_early(ex: Exchange, ctx: RequestContext, error_type: str, message: str) -> None:
    """End a response whose head is out: when the stream is SSE, the family's error events
    (`gateway.core.apis.stream_error`; an OpenAI error chunk + [DONE] for chat and text
    completions) and a clean end; otherwise cut the connection."""
    if ex.sse:
        data = apis.stream_error(api_of(ctx), error_type, message) or error_event(
            error_type, message
        )
        ctx.bytes_out += len(data)
        try:
            await ex.write(data)
            await ex.end()
        except (ConnectionError, OSError):
            ex.abort()
        return
    ex.abort()


async def _read_up_to(up: UpstreamResponse, first: bytes, limit: int) -> bytes:
    """Gather a JSON body until it is complete or passes `limit` (then it streams from there)."""
    parts = [first]
    size = len(first)
    while not up.complete and size <= limit:
        more = await up.read_chunk()
        if not more:
            break
        parts.append(more)
        size += len(more)
    return b"".join(parts)


def _loads(data: bytes) -> Any:
    if not data or data[:1] not in (b"{", b"["):
        return None
    try:
        return jsonfast.loads(data)
    except (ValueError, RecursionError):
        return None
