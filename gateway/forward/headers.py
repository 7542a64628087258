"""(compiled) Headers both ways, for both engines: hop-by-hop sets, the upstream request's headers,
the client response's header lines (from an upstream head or for an error), JSON error bodies.

Upstream response heads are validated before anything reaches the client (a status outside
100–599, or a header value with control bytes, which the upstream parser refuses, is a 502),
and the client's status line is written from the code, never from the upstream's reason
phrase. Header bytes are passed as they came.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Final, TypeVar

if TYPE_CHECKING:
    from gateway.context import RequestContext
    from gateway.policy.compiled import Endpoint

_monotonic: Final = time.monotonic  # a static: no module attribute lookup per call

# RFC 9110 §7.6.1 hop-by-hop fields, plus the ones a proxy rewrites itself: framing (the pool and
# the engines frame each side), Host (set to the endpoint), Expect (we stream the body ourselves).
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
REQUEST_DROP: Final = HOP_BY_HOP | {
    b"host",
    b"content-length",
    b"expect",
    b"x-forwarded-for",
    b"x-forwarded-proto",
}
# An upstream's own overhead figure (a Sluice in front of a Sluice) is replaced by this one's.
RESPONSE_DROP: Final = HOP_BY_HOP | {b"content-length", b"x-sluice-overhead-ms"}

# What `client_head` does with a response field, by its lowercased name.
_PASS: Final = 0
_CONTENT_LENGTH: Final = 1
_TRANSFER_ENCODING: Final = 2
_CONNECTION: Final = 3
_DROP: Final = 4
_DATE: Final = 5
_CONTENT_TYPE: Final = 6
_REQUEST_ID: Final = 7
_KIND_OF: Final = {
    **dict.fromkeys(RESPONSE_DROP, _DROP),
    b"content-length": _CONTENT_LENGTH,
    b"transfer-encoding": _TRANSFER_ENCODING,
    b"connection": _CONNECTION,
    b"date": _DATE,
    b"content-type": _CONTENT_TYPE,
    b"x-request-id": _REQUEST_ID,
}
# The same by the name as the upstream spelled it, learned: backends send the same few names in
# the same case on every answer, and one lookup replaces a lowercasing and two set lookups a
# field. Bounded in names and in their length: past it, names are lowercased as they come.
_KINDS_SEEN: Final[dict[bytes, int]] = {}
_MAX_SEEN: Final = 512
_MAX_SEEN_NAME: Final = 64
# A client's field names as sent → lowercased, learned the same way (clients send the same few
# names in the same case): the lowercased name comes with its hash made, for the set lookups.
_LOWER_SEEN: Final[dict[bytes, bytes]] = {}
# A client's field names as sent → the lowercased str key of the request's header dict.
_KEY_SEEN: Final[dict[bytes, str]] = {}
# The filters' header names (a policy's few: the request id, traceparent, the auth filter's claim
# headers) as bytes, learned by the name: encoded once, their hash made once, for the set of
# names the client's copies are dropped by.
_NAME_BYTES: Final[dict[str, bytes]] = {}


_K = TypeVar("_K", str, bytes)
_V = TypeVar("_V")


def _learn(seen: dict[_K, _V], name: _K, value: _V) -> _V:
    """`value` for `name`, kept in `seen` while it has room and the name is short."""
    if len(seen) < _MAX_SEEN and len(name) <= _MAX_SEEN_NAME:
        seen[name] = value
    return value


def lower_name(name: bytes) -> bytes:
    """A field name lowercased, learned (`_LOWER_SEEN`): the same object for the same name, its
    hash made once, for the engines' and this module's set lookups."""
    ln = _LOWER_SEEN.get(name)
    if ln is None:
        ln = _learn(_LOWER_SEEN, name, name.lower())
    return ln


def header_key(name: bytes) -> str:
    """A field name as the key of a request's header dict (latin-1, lowercased), learned as
    `lower_name` is."""
    k = _KEY_SEEN.get(name)
    if k is None:
        k = _learn(_KEY_SEEN, name, name.decode("latin-1").lower())
    return k


def header_value(value: bytes) -> str:
    """A field value as a str: UTF-8, any byte that is not kept as a surrogate (so nothing is
    lost); decoded strictly first, which is the cheaper call and the same text for valid UTF-8."""
    try:
        return value.decode()
    except UnicodeDecodeError:
        return value.decode("utf-8", "surrogateescape")


JSON = "application/json"  # content type of `error_body`
_THOUSANDTHS: Final = tuple(f"{i:03d}" for i in range(1000))  # a fraction's three digits


_PLAIN_CONNECTION: Final = frozenset({b"keep-alive", b"close", b"Keep-Alive", b"Close"})
_NOTHING: Final[frozenset[bytes]] = frozenset()


def connection_listed(value: bytes) -> AbstractSet[bytes]:
    """Names listed in a Connection header: hop-by-hop for this hop only (RFC 9110 §7.6.1)."""
    if value in _PLAIN_CONNECTION:  # the usual values: nothing more to drop
        return _NOTHING
    return {t.strip().lower() for t in value.split(b",") if t.strip()}


def error_body(error_type: str, message: str) -> bytes:
    return json.dumps(
        {"error": {"type": error_type, "message": message}}, separators=(",", ":")
    ).encode()


def retry_after_value(seconds: float) -> str:
    """Retry-After is whole seconds (RFC 9110 §10.2.3): round up, never below 1."""
    return str(max(1, math.ceil(seconds)))


def request_headers(
    raw: Sequence[tuple[bytes, bytes]], ctx: RequestContext, endpoint: Endpoint
) -> list[tuple[bytes, bytes]]:
    """Client headers minus hop-by-hop, plus Host, X-Forwarded-* and the filters' headers (a
    client header whose name a filter sets is replaced, never doubled)."""
    extra = ctx.upstream_headers
    # The filters' headers as bytes once (not a decode per client header to compare); a plain
    # loop: a comprehension is a function call of its own (Python 3.11).
    added: list[tuple[bytes, bytes]] = []
    names: set[bytes] | None = None
    if extra:
        names = set()
        for key, val in extra.items():
            kb = _NAME_BYTES.get(key)
            if kb is None:
                kb = _learn(_NAME_BYTES, key, key.encode("latin-1"))
            names.add(kb)
            if val:  # an empty value only strips the client's copy (e.g. a claim header)
                added.append((kb, val.encode("latin-1")))
    drop = REQUEST_DROP
    conn_listed: AbstractSet[bytes] | None = None
    xff = b""
    out: list[tuple[bytes, bytes]] = [(b"host", endpoint.address.encode())]
    for n, v in raw:
        ln = lower_name(n)
        if ln in drop:
            if ln == b"connection":  # `keep-alive` / `close` name nothing left to drop
                listed = connection_listed(v) - drop
                if listed:
                    conn_listed = listed if conn_listed is None else conn_listed | listed
            elif ln == b"x-forwarded-for":
                xff = v if not xff else xff + b", " + v
            continue
        if names is not None and ln in names:
            continue
        out.append((n, v))
    if conn_listed:
        out = [(n, v) for n, v in out if n.lower() not in conn_listed or n == b"host"]
    peer = ctx.info.peer.encode()
    out.append((b"x-forwarded-for", xff + b", " + peer if xff else peer))
    out.append((b"x-forwarded-proto", b"http"))
    out += added
    return out


class BadUpstreamHead(Exception):
    """The upstream response head cannot be passed on (→ 502)."""


class ClientHead:
    """The client's response head built from an upstream head."""

    __slots__ = ("lines", "length", "chunked", "date", "content_type")

    def __init__(self) -> None:
        self.lines = b""
        self.length: int | None = None
        self.chunked = False
        self.date = False
        self.content_type = b""


def client_head(
    status: int, headers: Sequence[tuple[bytes, bytes]], ctx: RequestContext
) -> ClientHead:
    """Hop-by-hop (and Connection-listed) fields dropped, the request id and the filters'
    response headers added. Raises BadUpstreamHead.

    Header values need no second check: the upstream pool's parser (llhttp, strict) refuses a
    control byte or a CR/LF in a value before the head gets here (a 502 as well); what is
    checked here is what llhttp lets through (the status range, Content-Length's digits)."""
    if not 100 <= status <= 599:
        raise BadUpstreamHead(f"invalid upstream status {status}")
    head = ClientHead()
    conn_listed: AbstractSet[bytes] | None = None
    has_rid = False
    parts: list[bytes] = []
    for n, v in headers:
        kind = _KINDS_SEEN.get(n)
        if kind is None:
            kind = _learn(_KINDS_SEEN, n, _KIND_OF.get(n.lower(), _PASS))
        if kind != _PASS:
            if kind <= _DROP:
                if kind == _CONTENT_LENGTH:
                    if not v.isdigit():
                        raise BadUpstreamHead("invalid upstream Content-Length")
                    head.length = int(v)
                elif kind == _TRANSFER_ENCODING:
                    head.chunked = True
                elif kind == _CONNECTION:  # `keep-alive` / `close` name nothing left to drop
                    listed = connection_listed(v) - RESPONSE_DROP
                    if listed:
                        conn_listed = listed if conn_listed is None else conn_listed | listed
                continue
            if kind == _DATE:
                head.date = True
            elif kind == _CONTENT_TYPE:
                head.content_type = v.lower()
            else:
                has_rid = True
        parts += (n, b": ", v, b"\r\n")  # no method call per field
    if head.chunked:
        head.length = None
    if conn_listed:  # rare: drop the fields the Connection header named too
        parts = [
            b"%b: %b\r\n" % (n, v)
            for n, v in headers
            if (ln := n.lower()) not in RESPONSE_DROP and ln not in conn_listed
        ]
    block = b"".join(parts)
    if ctx.request_id and not has_rid:
        block += b"x-request-id: %b\r\n" % ctx.request_id.encode("latin-1")
    for name, value in ctx.response_headers:
        block += _line(name, value)
    head.lines = block + overhead_line(ctx)
    return head


def overhead_line(ctx: RequestContext) -> bytes:
    """`x-sluice-overhead-ms`: the time since the request arrived, the upstream's time to its
    heads excluded (as LiteLLM's `x-litellm-overhead-duration-ms`); kept for the metric."""
    s = ctx.overhead_s = max(0.0, _monotonic() - ctx.started - ctx.upstream_s)
    us = int(s * 1_000_000.0 + 0.5)  # as "%.3f" of the milliseconds, without a float format
    # An f-string is built in one step; `bytes %` parses its format every time (~2x the cost).
    return f"x-sluice-overhead-ms: {us // 1000}.{_THOUSANDTHS[us % 1000]}\r\n".encode()


def response_lines(
    ctx: RequestContext,
    retry_after: float | None = None,
    extra: Sequence[tuple[str, str]] = (),
) -> bytes:
    """Header lines of a response Sluice writes itself (a JSON error)."""
    out = b"content-type: application/json\r\n"
    if retry_after is not None:
        out += b"retry-after: %b\r\n" % retry_after_value(retry_after).encode()
    if ctx.request_id:
        out += b"x-request-id: %b\r\n" % ctx.request_id.encode("latin-1")
    for name, value in extra:
        out += _line(name, value)
    for name, value in ctx.response_headers:
        out += _line(name, value)
    return out + overhead_line(ctx)


def _line(name: str, value: str) -> bytes:
    line = f"{name}: {value}\r\n".encode("latin-1", "replace")
    if line.count(b"\r") != 1 or line.count(b"\n") != 1:
        raise ValueError("CR/LF in a response header set by a filter")
    return line
