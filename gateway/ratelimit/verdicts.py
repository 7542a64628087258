"""What a refused or shed request gets: the 429 with Retry-After and `x-ratelimit-*` headers
(HTTP response headers; gRPC trailing metadata), and the 503s of the overload colours."""

from __future__ import annotations

from gateway.core.keystate import Code, KeyState
from gateway.core.overload import Colour
from gateway.core.verdict import GRPC_RESOURCE_EXHAUSTED, GRPC_UNAVAILABLE, Verdict, reject
from gateway.ratelimit.compiled import CompiledRule

REASON = {Code.QPS: "qps", Code.TOKENS: "tokens", Code.PRESSURE: "pressure"}
SHED_RETRY_S = {Colour.YELLOW: 1.0, Colour.RED: 2.0}

CONCURRENCY = reject(
    503, GRPC_UNAVAILABLE, "overloaded", "the backend pool is at its concurrency limit", 1.0
)
OVERRUN = reject(
    429,
    GRPC_RESOURCE_EXHAUSTED,
    "token_overrun",
    "the response used more tokens than were reserved for it",
)


def refused(rule: CompiledRule, ks: KeyState, code: Code, scale: float, now: float) -> Verdict:
    """429 / RESOURCE_EXHAUSTED for `rule`'s key `ks`. The numbers are the rule's (limits per
    window and bucket size); what remains is this replica's view, scaled up to the whole when
    the key decides locally on a share of it."""
    m = rule.math
    retry = max(ks.retry_after(m, scale, now, code), 0.001)
    headers: list[tuple[str, str]] = []
    local = 1.0 if ks.leased else scale
    if m.limit:
        q_reset = ks.retry_after(m, scale, now, Code.QPS)
        headers += [
            ("x-ratelimit-limit-requests", num(m.limit)),
            ("x-ratelimit-remaining-requests", num(ks.requests_left(m, scale, now) / local)),
            ("x-ratelimit-reset-requests", dur(q_reset)),
        ]
    if m.rate:
        left = ks.tokens_left(m, scale, now)
        headers += [
            ("x-ratelimit-limit-tokens", num(m.burst)),
            ("x-ratelimit-remaining-tokens", num(max(0.0, left) / local)),
            ("x-ratelimit-reset-tokens", dur((m.burst * local - left) / (m.rate * local))),
        ]
    what = "token budget" if code is Code.TOKENS else "rate limit"
    return reject(
        429,
        GRPC_RESOURCE_EXHAUSTED,
        "rate_limited",
        f"{what} of rule {rule.name} exceeded",
        retry,
        tuple(headers),
    )


def shed(colour: Colour, prio: int) -> Verdict:
    return reject(
        503,
        GRPC_UNAVAILABLE,
        "overloaded",
        f"shed while {colour.label} (priority class {prio})",
        SHED_RETRY_S.get(colour, 1.0),
    )


def num(x: float) -> str:
    return str(int(x)) if x >= 0 else "0"


def dur(s: float) -> str:
    """Seconds as OpenAI writes them ("0.25s", "12s")."""
    s = max(0.0, s)
    return f"{s:.3f}".rstrip("0").rstrip(".") + "s"
