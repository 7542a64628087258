"""A default never conflicts with a valid value of another field: writing one field of a
cross-checked pair (or chain) alone loads, and writing both in the wrong order is still refused
at the field the user wrote."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.errors import PolicyError
from gateway.policy.loader import load_policy

HEAD = """\
backends:
  - name: b
    endpoints: [{address: "127.0.0.1:9"}]
"""
ROUTES = """\
routes:
  - name: r
    match: {path_prefix: /}
    backend: b
"""
LIMITS = """\
filters: [ratelimit, route]
rate_limits:
  rules: [{name: all, key: [], qps: 10}]
"""


def load(tmp_path: Path, text: str) -> Any:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return load_policy(path)


@pytest.mark.parametrize(
    ("extra", "section", "expected"),
    [
        ("    health: {interval_s: 1}\n", "health", {"failing_interval_s": 1.0}),
        ("    health: {interval_s: 0.5}\n", "health", {"failing_interval_s": 0.5}),
        ("    health: {interval_s: 30}\n", "health", {"failing_interval_s": 2.0}),
        ("    breaker: {open_s: 120}\n", "breaker", {"max_open_s": 120.0}),
        ("    breaker: {open_s: 1}\n", "breaker", {"max_open_s": 60.0}),
        ("    outlier: {ejection_s: 600}\n", "outlier", {"max_ejection_s": 600.0}),
        ("    outlier: {ejection_s: 10}\n", "outlier", {"max_ejection_s": 300.0}),
    ],
)  # fmt: skip
def test_backend_defaults_follow_the_written_field(
    tmp_path: Path, extra: str, section: str, expected: dict[str, float]
) -> None:
    policy = load(tmp_path, HEAD + extra + ROUTES)
    got = getattr(policy.backends[0], section)
    assert {k: getattr(got, k) for k in expected} == expected


@pytest.mark.parametrize(
    ("extra", "section", "expected"),
    [
        ("  overload: {yellow_above: 0.7}\n", "overload",
         {"green_below": 0.7, "yellow_above": 0.7, "red_above": 0.95}),
        ("  overload: {yellow_above: 0.97}\n", "overload",
         {"green_below": 0.8, "yellow_above": 0.97, "red_above": 0.97}),
        ("  overload: {red_above: 0.5}\n", "overload",
         {"green_below": 0.5, "yellow_above": 0.5, "red_above": 0.5}),
        ("  overload: {green_below: 0.9}\n", "overload",
         {"green_below": 0.9, "yellow_above": 0.9, "red_above": 0.95}),
        ("  overload: {}\n", "overload",
         {"green_below": 0.8, "yellow_above": 0.85, "red_above": 0.95}),
        ("  concurrency: {max_limit: 32}\n", "concurrency",
         {"min_limit": 4, "initial_limit": 32, "max_limit": 32}),
        ("  concurrency: {min_limit: 100}\n", "concurrency",
         {"min_limit": 100, "initial_limit": 100, "max_limit": 1000}),
        ("  concurrency: {initial_limit: 2000}\n", "concurrency",
         {"min_limit": 4, "initial_limit": 2000, "max_limit": 2000}),
        ("  concurrency: {max_limit: 2}\n", "concurrency",
         {"min_limit": 2, "initial_limit": 2, "max_limit": 2}),
    ],
)  # fmt: skip
def test_rate_limit_defaults_keep_their_order(
    tmp_path: Path, extra: str, section: str, expected: dict[str, float]
) -> None:
    policy = load(tmp_path, HEAD + ROUTES + LIMITS + extra)
    got = getattr(policy.rate_limits, section)
    assert {k: getattr(got, k) for k in expected} == expected


def test_jwks_max_stale_follows_a_long_cache(tmp_path: Path) -> None:
    jwks = tmp_path / "jwks.json"
    jwks.write_text('{"keys": []}')
    text = (
        "filters: [auth, route]\n"
        "auth:\n  providers:\n"
        "    - {name: p, issuer: i, audiences: [], algorithms: [RS256],\n"
        f"       jwks: {{file: {str(jwks)!r}, cache_s: 100000}}}}\n"
    )
    (prov,) = load(tmp_path, HEAD + ROUTES + text).auth.providers
    assert prov.jwks.max_stale_s == 100000 and prov.jwks.cache_s == 100000


def test_header_block_default_follows_the_metadata_cap(tmp_path: Path) -> None:
    text = "limits: {grpc_max_metadata_bytes: 65536}\ndatapath: {enabled: true}\n"
    policy = load(tmp_path, HEAD + ROUTES + text)
    assert policy.datapath.max_header_block_bytes == 131072
    assert load(tmp_path, HEAD + ROUTES).datapath.max_header_block_bytes == 65536


def test_header_list_default_follows_the_header_caps(tmp_path: Path) -> None:
    """HTTP/2's header-list cap defaults to 32 KiB, and stays twice the largest header set a
    stream may carry (431 or metadata cap below it), unless written."""
    assert load(tmp_path, HEAD + ROUTES).limits.http2.max_header_list_bytes == 32768
    text = "limits: {max_header_bytes: 40000, grpc_max_metadata_bytes: 20000}\n"
    assert load(tmp_path, HEAD + ROUTES + text).limits.http2.max_header_list_bytes == 80000
    text = "limits: {grpc_max_metadata_bytes: 20000, http2: {max_header_list_bytes: 20000}}\n"
    assert load(tmp_path, HEAD + ROUTES + text).limits.http2.max_header_list_bytes == 20000


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("    health: {interval_s: 1, failing_interval_s: 3}\n",
         "4:49: backends[0].health.failing_interval_s: must not exceed interval_s"),
        ("    breaker: {open_s: 10, max_open_s: 5}\n",
         "4:39: backends[0].breaker.max_open_s: must not be below open_s"),
        ("    outlier: {ejection_s: 10, max_ejection_s: 5}\n",
         "4:47: backends[0].outlier.max_ejection_s: must not be below ejection_s"),
    ],
)  # fmt: skip
def test_written_values_are_still_checked(tmp_path: Path, extra: str, expected: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(HEAD + extra + ROUTES)
    with pytest.raises(PolicyError) as e:
        load_policy(path)
    assert any(line[len(str(path)) + 1 :].startswith(expected) for line in e.value.errors), (
        e.value.errors
    )


@pytest.mark.parametrize(
    "extra",
    [
        "  overload: {green_below: 0.9, yellow_above: 0.85}\n",
        "  concurrency: {min_limit: 10, max_limit: 5}\n",
    ],
)
def test_written_orders_are_still_checked(tmp_path: Path, extra: str) -> None:
    with pytest.raises(PolicyError, match="need"):
        load(tmp_path, HEAD + ROUTES + LIMITS + extra)
