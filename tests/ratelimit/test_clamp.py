"""The priority clamp of `admission.priority`: a client lowers its class freely and raises it
only up to the ceiling its claim allows; the limits and the queue use the same class."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.policy.compiled import compile_policy
from gateway.policy.model import Policy
from gateway.ratelimit.compiled import ClampedPriority, compile_limits, priority_of

DOC: dict[str, Any] = {
    "backends": [{"name": "b", "endpoints": [{"address": "127.0.0.1:9"}]}],
    "routes": [{"name": "r", "match": {"protocol": "http"}, "backend": "b"}],
    "rate_limits": {"priority": {"from": "header:x-other", "classes": {"x": 0}, "default": 0},
                    "rules": [{"name": "q", "key": [], "qps": 100}]},
    "admission": {"priority": {"header": "X-Sluice-Priority", "ceiling": {
        "from": "claim:tier", "classes": {"gold": 0, "silver": 1, "free": 2}, "default": 2}}},
}  # fmt: skip


@pytest.mark.parametrize(
    ("tier", "asked", "effective"),
    [
        ("gold", None, 0),  # no header: the ceiling
        ("gold", "free", 2),  # lower, freely
        ("gold", "Silver ", 1),  # names are case- and space-insensitive
        ("free", "gold", 2),  # higher than the ceiling: clamped to it
        ("silver", "gold", 1),
        ("silver", "0", 1),  # numbers too
        ("silver", "2", 2),
        ("silver", "9", 2),  # below the lowest class: the lowest
        ("silver", "platinum", 1),  # unknown: ignored
        ("silver", "99999", 1),
        (None, None, 2),  # no claim: the ceiling's default
        (None, "gold", 2),
        ("unknown", "silver", 2),
    ],
)
def test_clamp(tier: str | None, asked: str | None, effective: int) -> None:
    fn, top, lowest = priority_of(compile_policy(Policy.model_validate(DOC)))
    assert isinstance(fn, ClampedPriority) and (top, lowest) == (0, 2)
    headers = {"x-sluice-priority": asked} if asked is not None else {}
    claims = {"tier": tier} if tier is not None else {}
    assert fn.of(headers, claims) == effective


def test_the_limits_use_the_clamped_class_and_queue_at_the_pool_limit() -> None:
    policy = compile_policy(Policy.model_validate(DOC))
    assert policy.policy.rate_limits is not None
    c = compile_limits(policy.policy.rate_limits, policy)
    assert isinstance(c.priority, ClampedPriority) and c.queued and c.lowest == 2


def test_without_admission_the_limits_keep_their_own_priority() -> None:
    doc = {k: v for k, v in DOC.items() if k != "admission"}
    policy = compile_policy(Policy.model_validate(doc))
    assert policy.policy.rate_limits is not None
    c = compile_limits(policy.policy.rate_limits, policy)
    assert not isinstance(c.priority, ClampedPriority) and not c.queued
