"""The charts' series: p99 from histogram bucket deltas, rates, shares, bounds."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.status.series import KEEP_S, MAX_TENANTS, Series, p99_ms

INF = float("inf")


@pytest.mark.parametrize(
    ("now", "before", "expected"),
    [
        ({0.1: 99.0, 1.0: 100.0, INF: 100.0}, None, 100.0),  # 99 % at or under 0.1 s
        ({0.1: 98.0, 1.0: 100.0, INF: 100.0}, None, 1000.0),
        ({0.1: 150.0, 1.0: 200.0, INF: 200.0}, {0.1: 100.0, 1.0: 100.0, INF: 100.0}, 1000.0),
        ({0.1: 5.0, INF: 5.0}, {0.1: 5.0, INF: 5.0}, None),  # nothing new: no point
        ({0.1: 0.0, INF: 3.0}, None, None),  # past the last bound: unknown, not infinite
        (None, None, None),
    ],
)
def test_p99_of_an_interval(now: Any, before: Any, expected: float | None) -> None:
    assert p99_ms(now, before) == expected


def doc(served: dict[str, float], queued: int) -> dict[str, Any]:
    tenants = [{"tenant": k, "served_tokens": v} for k, v in served.items()]
    pool = {"pool": "sim", "queued": queued, "tenants": tenants}
    return {"backends": {"backends": [{"name": "sim"}]}, "admission": {"pools": [pool]}}


def counts(requests: float) -> dict[str, Any]:
    return {"requests": {"sim": requests}, "latency": {}, "ttft": {}}


def test_rates_queues_and_shares_per_interval() -> None:
    s = Series(5.0)
    s.sample(100.0, counts(0), doc({"a": 0, "b": 0}, 0))  # the first sample is the baseline
    s.sample(105.0, counts(50), doc({"a": 300, "b": 100}, 7))
    s.sample(110.0, counts(50), doc({"a": 300, "b": 200}, 0))
    st = s.state()
    assert st["t"] == [105.0, 110.0]
    assert st["backends"]["sim"]["rps"] == [10.0, 0.0]
    assert st["backends"]["sim"]["p99_ms"] == [None, None]
    assert st["queues"]["sim"] == [7.0, 0.0]
    assert st["tenants"] == {"a": [0.75, 0.0], "b": [0.25, 1.0]}


def test_lines_are_bounded_in_length_and_tenants() -> None:
    s = Series(1.0)
    for i in range(2000):
        served = {f"t{i // 10 + k}": float(i * (k + 1)) for k in range(10)}
        s.sample(float(i), counts(i), doc(served, i % 5))
    st = s.state()
    assert len(st["t"]) == 900 and len(st["backends"]["sim"]["rps"]) == 900
    assert len(st["tenants"]) <= 2 * MAX_TENANTS
    assert all(len(v) == 900 for v in st["tenants"].values())


def test_lines_of_what_left_go_once_nothing_is_left_to_draw() -> None:
    # Backends and pools renamed by reloads, tenants that stopped: their lines go once their
    # window holds no point, so the series follow what is current, not every name since start.
    s = Series(1.0)
    n = int(KEEP_S) + 2
    for gen in range(5):
        b, pool, tenant = f"b{gen}", f"p{gen}", f"t{gen}"
        for i in range(n):
            t = float(gen * n + i)
            d = {
                "backends": {"backends": [{"name": b}]},
                "admission": {"pools": [{"pool": pool, "queued": 1,
                                         "tenants": [{"tenant": tenant, "served_tokens": t}]}]},
            }  # fmt: skip
            s.sample(t, {"requests": {b: t}, "latency": {}, "ttft": {}}, d)
            if gen and i == n // 2:  # the previous ones are still drawn
                st = s.state()
                assert f"b{gen - 1}" in st["backends"] and f"t{gen - 1}" in st["tenants"]
    st = s.state()
    assert set(st["backends"]) == {"b4"} and set(st["queues"]) == {"p4"}
    assert set(st["tenants"]) == {"t4"}
    lines = [*st["backends"]["b4"].values(), *st["queues"].values(), *st["tenants"].values()]
    assert all(len(line) == len(st["t"]) for line in lines)
