"""(compiled) Verdict: what the chain decided about a request; the forwarding path turns it into
bytes.

A rejection carries everything the client sees: HTTP status, gRPC code, the JSON error's `type`
and message, `Retry-After`, and extra headers (HTTP response headers; gRPC trailing metadata),
e.g. `WWW-Authenticate` or `x-ratelimit-*`. Every refusal of the request path, from a header
bound to a rate limit, is one of these.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

Headers = tuple[tuple[str, str], ...]  # lower-case names


class Action(enum.Enum):
    ALLOW = "allow"
    REJECT = "reject"
    SHADOW_REJECT = "shadow_reject"  # logged and counted, request proceeds


# Numeric gRPC status codes (core never imports grpc).
GRPC_OK: Final = 0
GRPC_CANCELLED = 1
GRPC_UNKNOWN = 2
GRPC_INVALID_ARGUMENT = 3
GRPC_DEADLINE_EXCEEDED = 4
GRPC_NOT_FOUND = 5
GRPC_PERMISSION_DENIED = 7
GRPC_RESOURCE_EXHAUSTED = 8
GRPC_UNIMPLEMENTED = 12
GRPC_INTERNAL = 13
GRPC_UNAVAILABLE = 14
GRPC_UNAUTHENTICATED = 16


@dataclass(frozen=True, slots=True)
class Verdict:
    action: Action
    http_status: int = 200
    grpc_status: int = GRPC_OK
    error_type: str = ""  # machine-readable, e.g. "rate_limited"; goes into the JSON error body
    reason: str = ""  # short human text, safe to show the client (never a secret or a token)
    retry_after: float | None = None  # seconds; sent as Retry-After (HTTP and gRPC trailer)
    headers: Headers = ()  # HTTP response headers / gRPC trailing metadata, lower-case names
    body: bytes = b""  # HTTP: the JSON body to answer instead of the standard error body

    @property
    def allowed(self) -> bool:
        return self.action is not Action.REJECT


ALLOW = Verdict(Action.ALLOW)


def reject(
    http_status: int,
    grpc_status: int,
    error_type: str,
    reason: str,
    retry_after: float | None = None,
    headers: Headers = (),
) -> Verdict:
    return Verdict(
        Action.REJECT, http_status, grpc_status, error_type, reason, retry_after, headers
    )


def answer(
    http_status: int, grpc_status: int, error_type: str, reason: str, body: bytes
) -> Verdict:
    """An answer of Sluice's own with its JSON `body` (HTTP): an OpenAI-style error, or a 200
    (e.g. a model list) that ends the request without a backend."""
    return Verdict(Action.REJECT, http_status, grpc_status, error_type, reason, body=body)


# The refusals of the request path itself (filters add their own).
NO_ROUTE = reject(404, GRPC_UNIMPLEMENTED, "no_route", "no route matches this request")
NO_ENDPOINT = reject(503, GRPC_UNAVAILABLE, "no_healthy_upstream", "no backend available", 1.0)
HEADERS_TOO_LARGE = reject(
    431, GRPC_RESOURCE_EXHAUSTED, "headers_too_large", "request header fields too large"
)
BAD_PATH = reject(400, GRPC_INVALID_ARGUMENT, "bad_path", "path not allowed")
BODY_TOO_LARGE = reject(413, GRPC_RESOURCE_EXHAUSTED, "body_too_large", "body too large")
BODY_TIMEOUT = reject(
    408, GRPC_DEADLINE_EXCEEDED, "body_timeout", "request body not received in time"
)
BAD_EXPECT = reject(
    417, GRPC_INVALID_ARGUMENT, "expectation_failed", "only 100-continue is supported"
)
