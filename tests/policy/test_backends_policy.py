"""The backends issue's policy validates as written; its mistakes point at their line."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.errors import PolicyError
from gateway.policy.compiled import compile_policy
from gateway.policy.loader import load_policy

# The issue's example, verbatim, plus the canary backend it refers to.
ISSUE = """\
backends:
  - name: vllm
    protocol: http
    endpoints: [{address: "10.0.0.11:8000"}, {address: "10.0.0.12:8000"}]
    discovery: {registry: {redis: "redis://127.0.0.1:6379/0", service: vllm-llama}}   # optional, adds members
    health: {path: "/healthz?deep=true", interval_s: 30, unhealthy_after: 3, healthy_after: 2}
    breaker: {consecutive_failures: 5, error_ratio: 0.5, slow_call_s: 10, min_requests: 20, open_s: 5}
    outlier: {timeout_ratio: 0.15, window_s: 120, max_ejected: 0.5}
  - name: vllm-canary
    endpoints: [{address: "10.0.0.21:8000"}]
routes:
  - name: chat
    match: {protocol: http, path_prefix: /v1/}
    backends: [{backend: vllm, weight: 90}, {backend: vllm-canary, weight: 10}]
    canary: {backend: vllm-canary, p95_ms: 200, max_error_ratio: 0.02, window_s: 60, override_header: x-sluice-canary}
    retries: {attempts: 2, budget_ratio: 0.2, per_try_timeout_s: 5}
"""  # noqa: E501 (verbatim)


def load(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    try:
        load_policy(path)
    except PolicyError as e:
        return [line[len(str(path)) + 1 :] for line in e.errors]
    return []


def test_the_issue_policy_validates_and_compiles(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(ISSUE)
    c = compile_policy(load_policy(path))
    (route,) = c.routes
    assert route.targets == (("vllm", 90), ("vllm-canary", 10))
    assert route.retries is not None and route.try_timeouts is not None
    assert route.try_timeouts.first_byte_s == 5 and route.try_timeouts.connect_s == 2
    b = c.backends["vllm"]
    assert b.breaker is not None and b.breaker.probe_timeout_s is None  # → slow_call_s
    assert b.discovery is not None and b.discovery.registry.stale_after_s == 5.0


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("canary: {backend: vllm-canary,", "canary: {backend: vllm-x,",
         "15:23: routes[0].canary.backend: 'vllm-x' is not one of this route's backends"),
        ('redis: "redis://127.0.0.1:6379/0"', 'redis: "http://x"',
         "5:35: backends[0].discovery.registry.redis: String should match pattern"),
        ('endpoints: [{address: "10.0.0.21:8000"}]', "endpoints: []",
         "10:16: backends[1].endpoints: needs at least one endpoint or `discovery`"),
        ('{address: "10.0.0.12:8000"}', '{address: "10.0.0.11:8000"}',
         "4:56: backends[0].endpoints[1].address: duplicate address"),
        ("attempts: 2", "attempts: 9",
         "16:25: routes[0].retries.attempts: Input should be less than or equal to 5"),
        ("error_ratio: 0.5,", "error_ratio: 0,",
         "7:53: backends[0].breaker.error_ratio: Input should be greater than 0"),
        ("interval_s: 30,", "interval_s: 1, failing_interval_s: 3,",
         "6:77: backends[0].health.failing_interval_s: must not exceed interval_s"),
    ],
)  # fmt: skip
def test_mistakes_point_at_their_line(tmp_path: Path, old: str, new: str, expected: str) -> None:
    assert old in ISSUE
    errors = load(tmp_path, ISSUE.replace(old, new, 1))
    assert any(e.startswith(expected) for e in errors), errors


def test_a_canary_needs_a_split(tmp_path: Path) -> None:
    text = ISSUE.replace(
        "backends: [{backend: vllm, weight: 90}, {backend: vllm-canary, weight: 10}]",
        "backend: vllm",
    )
    errors = load(tmp_path, text)
    assert any("a canary needs a `backends` split" in e for e in errors), errors
