"""(compiled) Retries: which failures are safe to retry, and a budget that keeps retries from piling
on.

Pure. A try may be retried only when the request surely did not reach the model or the backend
refused it outright, and nothing of the answer has reached the client:

- the connection could not be made (connect refused / timed out, no free connection), or
- the backend answered 503 (HTTP) / UNAVAILABLE (gRPC) before any byte went to the client, or
- with `before_first_token`: the backend failed (reset, 5xx, an SSE error event, a stall) before
  the answer's first token, which the forwarding path holds back until then.

Never once a response started streaming (the client already has part of an answer), never for
a timeout after the request was sent (the model may be generating: a retry would run it twice).

The budget (Envoy's retry budget): retries in flight may not exceed `budget_ratio` of the
requests active on the route, with a floor of `min_retries`, so that a failing backend under load
sees at most ~20 % extra traffic instead of a retry storm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from gateway.core.outcome import Outcome
from gateway.core.verdict import GRPC_UNAVAILABLE

# Outcomes of a try that never reached the backend's application.
_CONNECT: Final = frozenset({Outcome.UPSTREAM_CONNECT, Outcome.UPSTREAM_TLS})
# Failures of a try whose answer had not begun (with `before_first_token`).
_BEFORE_TOKEN: Final = frozenset(
    {Outcome.UPSTREAM_PROTOCOL, Outcome.UPSTREAM_TIMEOUT, Outcome.UPSTREAM_ERROR}
)


@dataclass(frozen=True, slots=True)
class RetryParams:
    attempts: int = 2  # tries in total, the first included
    budget_ratio: float = 0.2
    min_retries: int = 3
    per_try_timeout_s: float | None = None  # each try, up to its first response byte
    on_connect_failure: bool = True
    on_unavailable: bool = True
    # Also a reset, an error, a 5xx or a stall before the answer's first token (the forwarding
    # path holds a stream's start until then, so nothing reached the client).
    before_first_token: bool = False


def retriable(
    p: RetryParams,
    outcome: Outcome,
    http_status: int,
    grpc_status: int | None,
    responded: bool,
) -> bool:
    """Is this failed try safe to retry? `responded`: a byte of the answer reached the client."""
    if responded:
        return False
    if outcome in _CONNECT:
        return p.on_connect_failure
    if p.before_first_token and outcome in _BEFORE_TOKEN:
        return True
    if not p.on_unavailable:
        return False
    if grpc_status is not None:
        return grpc_status == GRPC_UNAVAILABLE
    return http_status == 503


class RetryBudget:
    """Counts requests active on a route and the retries among them."""

    __slots__ = ("ratio", "floor", "active", "retrying", "granted", "refused")

    def __init__(self, ratio: float, floor: int) -> None:
        self.ratio = ratio
        self.floor = floor
        self.active = 0  # requests in flight on the route
        self.retrying = 0  # retries in flight
        self.granted = 0  # retries allowed since start
        self.refused = 0  # retries refused for want of budget since start

    def limit(self) -> int:
        """How many retries may be in flight now."""
        return max(self.floor, math.floor(self.ratio * self.active + 1e-9))

    def try_acquire(self) -> bool:
        if self.retrying < self.limit():
            self.retrying += 1
            self.granted += 1
            return True
        self.refused += 1
        return False

    def release(self) -> None:
        if self.retrying > 0:
            self.retrying -= 1

    def snapshot(self) -> dict[str, int]:
        return {
            "active": self.active,
            "retries_in_flight": self.retrying,
            "limit": self.limit(),
            "granted": self.granted,
            "refused": self.refused,
        }
