"""What a request a budget refuses gets: 429 (exhausted) or 503 (the store is unreachable and
the rule fails closed), with the budget's name, remaining tokens and reset time in headers
(`x-sluice-budget`, `x-sluice-budget-remaining`, `x-sluice-budget-reset`, Retry-After) and in
the error body: OpenAI's families get `error_body` (with the budget's fields), Anthropic's get
their own dialect from the answer path (`gateway.core.apis.error_answer`, the budget's name,
remaining tokens and reset time in its message)."""

from __future__ import annotations

import json

from gateway.core import apis
from gateway.core.verdict import (
    GRPC_RESOURCE_EXHAUSTED,
    GRPC_UNAVAILABLE,
    Action,
    Verdict,
)

STORE_DOWN_RETRY_S = 1.0


def error_body(kind: str, message: str, budget: str, remaining: int, resets_at: str) -> bytes:
    """The JSON error body (OpenAI's shape: `{"error": {"message", "type", "code", ...}}`)."""
    return json.dumps(
        {
            "error": {
                "message": message,
                "type": kind,
                "code": kind,
                "param": None,
                "budget": budget,
                "remaining_tokens": remaining,
                "resets_at": resets_at,
            }
        },
        separators=(",", ":"),
    ).encode()


def exhausted(
    budget: str, remaining: int, needed: int, resets_at: str, retry: float, api: str = ""
) -> Verdict:
    message = (
        f"token budget {budget} exhausted: {remaining} tokens left, this request needs up "
        f"to {needed}; it resets at {resets_at}"
    )
    return _verdict(429, GRPC_RESOURCE_EXHAUSTED, "budget_exceeded", message, budget, remaining,
                    resets_at, max(retry, 0.001), api)  # fmt: skip


def store_down(budget: str, remaining: int, resets_at: str, api: str = "") -> Verdict:
    message = f"token budget {budget} cannot be checked now (its store is unreachable)"
    return _verdict(503, GRPC_UNAVAILABLE, "budget_unavailable", message, budget, remaining,
                    resets_at, STORE_DOWN_RETRY_S, api)  # fmt: skip


def _verdict(
    status: int, grpc: int, kind: str, message: str, budget: str, remaining: int,
    resets_at: str, retry: float, api: str,
) -> Verdict:  # fmt: skip
    headers = (
        ("x-sluice-budget", budget),
        ("x-sluice-budget-remaining", str(max(0, remaining))),
        ("x-sluice-budget-reset", resets_at),
    )
    body = b""  # Anthropic's families: their dialect, made where the answer is written
    if api not in apis.ANTHROPIC:
        body = error_body(kind, message, budget, max(0, remaining), resets_at)
    return Verdict(Action.REJECT, status, grpc, kind, message, retry, headers, body)
