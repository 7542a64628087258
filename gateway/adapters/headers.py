"""Header helpers shared by the HTTP ingress and the upstream pool: hop-by-hop sets, JSON errors."""

from __future__ import annotations

import json
import math

# RFC 9110 §7.6.1 hop-by-hop fields, plus the ones a proxy rewrites itself: framing (the pool and
# aiohttp frame each side), Host (set to the endpoint), Expect (we stream the body ourselves).
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
REQUEST_DROP = HOP_BY_HOP | {
    b"host",
    b"content-length",
    b"expect",
    b"x-forwarded-for",
    b"x-forwarded-proto",
}
RESPONSE_DROP = HOP_BY_HOP | {b"content-length"}

JSON = "application/json"  # content type of `error_body`


def connection_listed(value: bytes) -> set[bytes]:
    """Names listed in a Connection header: hop-by-hop for this hop only (RFC 9110 §7.6.1)."""
    return {t.strip().lower() for t in value.split(b",") if t.strip()}


def error_body(error_type: str, message: str) -> bytes:
    return json.dumps(
        {"error": {"type": error_type, "message": message}}, separators=(",", ":")
    ).encode()


def retry_after_value(seconds: float) -> str:
    """Retry-After is whole seconds (RFC 9110 §10.2.3): round up, never below 1."""
    return str(max(1, math.ceil(seconds)))
