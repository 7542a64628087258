"""Verdict: what the chain decided about a request; adapters turn it into bytes."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Action(enum.Enum):
    ALLOW = "allow"
    REJECT = "reject"
    SHADOW_REJECT = "shadow_reject"  # logged and counted, request proceeds


# Numeric gRPC status codes (core never imports grpc).
GRPC_OK = 0
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
    retry_after: float | None = None  # seconds; sent as Retry-After on 429/503

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
) -> Verdict:
    return Verdict(Action.REJECT, http_status, grpc_status, error_type, reason, retry_after)


NO_ROUTE = reject(404, GRPC_UNIMPLEMENTED, "no_route", "no route matches this request")
