"""Retries: the safe-to-retry table and the budget (20 % of active requests, at least 3)."""

from __future__ import annotations

import pytest

from gateway.core.outcome import Outcome
from gateway.core.retry import RetryBudget, RetryParams, retriable

P = RetryParams()


@pytest.mark.parametrize(
    ("outcome", "http", "grpc", "responded", "ok"),
    [
        (Outcome.UPSTREAM_CONNECT, 0, None, False, True),
        (Outcome.UPSTREAM_TLS, 0, None, False, True),  # the handshake failed: nothing was sent
        (Outcome.OK, 503, None, False, True),
        (Outcome.OK, 503, None, True, False),  # a byte reached the client: never
        (Outcome.OK, 500, None, False, False),
        (Outcome.OK, 502, None, False, False),
        (Outcome.UPSTREAM_TIMEOUT, 0, None, False, False),  # the model may be generating
        (Outcome.UPSTREAM_PROTOCOL, 0, None, False, False),  # reset after the request went out
        (Outcome.UPSTREAM_ERROR, 0, 14, False, True),  # gRPC UNAVAILABLE
        (Outcome.UPSTREAM_ERROR, 0, 13, False, False),  # INTERNAL
        (Outcome.UPSTREAM_ERROR, 0, 14, True, False),
        (Outcome.CLIENT_CANCELLED, 0, None, False, False),
    ],
)
def test_what_is_safe_to_retry(
    outcome: Outcome, http: int, grpc: int | None, responded: bool, ok: bool
) -> None:
    assert retriable(P, outcome, http, grpc, responded) is ok


def test_retry_on_switches() -> None:
    only_connect = RetryParams(on_unavailable=False)
    assert not retriable(only_connect, Outcome.OK, 503, None, False)
    assert retriable(only_connect, Outcome.UPSTREAM_CONNECT, 0, None, False)
    only_503 = RetryParams(on_connect_failure=False)
    assert not retriable(only_503, Outcome.UPSTREAM_CONNECT, 0, None, False)


@pytest.mark.parametrize(("active", "limit"), [(0, 3), (10, 3), (15, 3), (20, 4), (100, 20)])
def test_budget_limit(active: int, limit: int) -> None:
    b = RetryBudget(0.2, 3)
    b.active = active
    assert b.limit() == limit


def test_budget_bounds_retries_in_flight() -> None:
    b = RetryBudget(0.2, 3)
    b.active = 50  # limit 10
    assert all(b.try_acquire() for _ in range(10))
    assert not b.try_acquire()
    b.release()
    assert b.try_acquire()
    assert b.snapshot() == {"active": 50, "retries_in_flight": 10, "limit": 10, "granted": 11,
                            "refused": 1}  # fmt: skip
