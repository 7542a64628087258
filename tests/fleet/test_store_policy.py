"""The top-level `store:` section and how it combines with `rate_limits.store`."""

from __future__ import annotations

import pytest

from gateway.errors import PolicyError
from gateway.policy.loader import load_policy_text
from gateway.policy.store import effective_store, limits_store

BASE = """
backends:
  - name: b
    endpoints: [{address: "127.0.0.1:9"}]
routes:
  - name: r
    match: {path_prefix: /}
    backend: b
"""


def test_top_level_store_is_the_fleets_and_the_limits() -> None:
    p = load_policy_text(
        BASE + 'store: {redis: {url: "redis://10.0.0.1:6379/0", sync_interval_ms: 25}}\n'
        "rate_limits: {rules: [{name: t, key: [], qps: 5}]}\n"
    )
    assert p.store is not None
    fleet = effective_store(p.store, p.rate_limits)
    assert fleet is not None and fleet.url == "redis://10.0.0.1:6379/0"
    assert fleet.sync_interval_ms == 25
    assert limits_store(p.store, p.rate_limits) == fleet


def test_rate_limits_store_alone_keeps_working_and_is_the_fleets() -> None:
    p = load_policy_text(
        BASE + "rate_limits:\n"
        '  store: {redis: {url: "redis://10.0.0.2:6379/0"}}\n'
        "  rules: [{name: t, key: [], qps: 5}]\n"
    )
    assert p.store is None
    fleet = effective_store(p.store, p.rate_limits)
    assert fleet is not None and fleet.url == "redis://10.0.0.2:6379/0"
    assert limits_store(p.store, p.rate_limits) == fleet


def test_no_store_anywhere_is_none() -> None:
    p = load_policy_text(BASE + "rate_limits: {rules: [{name: t, key: [], qps: 5}]}\n")
    assert effective_store(p.store, p.rate_limits) is None
    assert limits_store(p.store, p.rate_limits) is None
    assert effective_store(load_policy_text(BASE).store, None) is None


def test_explicit_memory_keeps_the_limits_local_beside_a_fleet_store() -> None:
    p = load_policy_text(
        BASE + 'store: {redis: {url: "redis://10.0.0.1:6379/0"}}\n'
        "rate_limits: {store: memory, rules: [{name: t, key: [], qps: 5}]}\n"
    )
    assert effective_store(p.store, p.rate_limits) is not None
    assert limits_store(p.store, p.rate_limits) is None


def test_the_same_store_twice_is_fine() -> None:
    p = load_policy_text(
        BASE + 'store: {redis: {url: "redis://10.0.0.1:6379/0"}}\n'
        "rate_limits:\n"
        '  store: {redis: {url: "redis://10.0.0.1:6379/0"}}\n'
        "  rules: [{name: t, key: [], qps: 5}]\n"
    )
    assert p.store is not None


def test_two_different_stores_are_refused_at_the_limits_store() -> None:
    text = (
        BASE + 'store: {redis: {url: "redis://10.0.0.1:6379/0"}}\n'
        "rate_limits:\n"
        '  store: {redis: {url: "redis://10.0.0.9:6379/0"}}\n'
        "  rules: [{name: t, key: [], qps: 5}]\n"
    )
    with pytest.raises(PolicyError) as err:
        load_policy_text(text, "p.yaml")
    msg = str(err.value)
    line = text.splitlines().index('  store: {redis: {url: "redis://10.0.0.9:6379/0"}}') + 1
    assert f"p.yaml:{line}:" in msg and "differs from the top-level `store`" in msg


def test_store_options_are_checked() -> None:
    with pytest.raises(PolicyError) as err:
        load_policy_text(BASE + 'store: {redis: {url: "http://x", bogus: 1}}\n', "p.yaml")
    assert "p.yaml:" in str(err.value)
