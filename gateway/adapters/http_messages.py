"""Translation between aiohttp's request/response and the pool's raw headers and body chunks.

Client headers → upstream headers (hop-by-hop dropped, Host and X-Forwarded-* set), upstream
head → client response head, and the client body read whole (small) or streamed under a limit.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway.adapters.headers import REQUEST_DROP, RESPONSE_DROP, connection_listed

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from gateway.filters.base import RequestContext
    from gateway.policy.compiled import Endpoint


class BodyTooLarge(Exception):
    """The client body grew past `max_body_bytes` while it was streamed (→ 413)."""


class ProxyResponse(web.StreamResponse):
    """A StreamResponse whose head leaves with the first body bytes: one write, not two.

    (aiohttp's plain `Response` does this; `StreamResponse` flushes the head in `prepare()`.
    We always hold the first chunk when we prepare, so nothing waits for it.)"""

    _send_headers_immediately = False


async def read_small(request: web.BaseRequest, length: int) -> bytes:
    """A small body of known length: usually already buffered, so no read loop, no copy."""
    content = request.content
    data = content.read_nowait(-1)
    if len(data) < length:
        data += await content.readexactly(length - len(data))
    return data


def may_have_body(method: str, status: int) -> bool:
    return method != "HEAD" and status >= 200 and status not in (204, 304)


async def stream_body(
    request: web.BaseRequest, ctx: RequestContext, limit: int
) -> AsyncIterator[bytes]:
    async for chunk in request.content.iter_any():
        ctx.bytes_in += len(chunk)
        if ctx.bytes_in > limit:
            raise BodyTooLarge()
        yield chunk


def upstream_headers(
    raw: Any, ctx: RequestContext, endpoint: Endpoint
) -> list[tuple[bytes, bytes]]:
    """Client headers minus hop-by-hop, plus Host, X-Forwarded-* and the filters' headers."""
    extra = ctx.upstream_headers
    drop = REQUEST_DROP
    conn_listed: set[bytes] | None = None
    xff = b""
    out: list[tuple[bytes, bytes]] = [(b"host", endpoint.address.encode())]
    for n, v in raw:
        ln = n.lower()
        if ln in drop:
            if ln == b"connection":
                conn_listed = connection_listed(v)
            elif ln == b"x-forwarded-for":
                xff = v if not xff else xff + b", " + v
            continue
        if extra and ln.decode("latin-1") in extra:
            continue
        out.append((n, v))
    if conn_listed:
        out = [(n, v) for n, v in out if n.lower() not in conn_listed or n == b"host"]
    peer = ctx.info.peer.encode()
    out.append((b"x-forwarded-for", xff + b", " + peer if xff else peer))
    out.append((b"x-forwarded-proto", b"http"))
    for name, value in extra.items():
        if value:  # "" = only drop the client's copy (see RequestContext.upstream_headers)
            out.append((name.encode("latin-1"), value.encode("latin-1")))
    return out


def response_head(
    status: int, reason: str, headers: list[tuple[bytes, bytes]]
) -> tuple[web.StreamResponse, int | None]:
    """The client response for an upstream head: hop-by-hop dropped, length kept if known."""
    resp = ProxyResponse(status=status, reason=reason or None)
    h = resp.headers
    length: int | None = None
    chunked = False
    conn_listed: set[bytes] | None = None
    for n, v in headers:
        ln = n.lower()
        if ln in RESPONSE_DROP:
            if ln == b"content-length":
                with contextlib.suppress(ValueError):
                    length = int(v)
            elif ln == b"transfer-encoding":
                chunked = True
            elif ln == b"connection":
                conn_listed = connection_listed(v)
            continue
        if conn_listed is not None and ln in conn_listed:
            continue
        h.add(n.decode("latin-1"), v.decode("latin-1"))
    if conn_listed:
        for name in conn_listed:
            h.popall(name.decode("latin-1"), None)
    if length is not None and not chunked:
        resp.content_length = length
    else:
        length = None
    return resp, length
