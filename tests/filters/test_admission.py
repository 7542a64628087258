"""Which pools the admission filter queues at, and with how many slots (per worker)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.admission.owner import PoolSpec
from gateway.filters.admission import Weight, pool_specs
from gateway.policy.compiled import compile_policy
from gateway.policy.model import Policy


def specs(backends: list[dict[str, Any]], workers: int = 1, adaptive: bool = False,
          routes: list[dict[str, Any]] | None = None) -> dict[str, PoolSpec]:  # fmt: skip
    doc: dict[str, Any] = {
        "backends": backends,
        "routes": routes or [{"name": "r", "backend": backends[0]["name"]}],
        "admission": {},
    }
    if adaptive:
        doc["rate_limits"] = {"concurrency": {"latency_slo_ms": 500}}
    return pool_specs(compile_policy(Policy.model_validate(doc)), workers)


TWO = [{"address": "127.0.0.1:1"}, {"address": "127.0.0.1:2"}]


@pytest.mark.parametrize(
    ("max_in_flight", "workers", "adaptive", "expected"),
    [
        (8, 1, False, PoolSpec("a", 16, (("a", 8),), 1, 16)),  # per member × members
        (8, 3, False, PoolSpec("a", 6, (("a", 8),), 3, 16)),  # 1/N per worker, rounded up
        (None, 1, True, PoolSpec("a", 0)),  # the adaptive limit sets it
        (None, 1, False, None),  # no limit: never queues
    ],
)
def test_pool_slots(max_in_flight: int | None, workers: int, adaptive: bool,
                    expected: PoolSpec | None) -> None:  # fmt: skip
    b: dict[str, Any] = {"name": "a", "endpoints": TWO}
    if max_in_flight:
        b["max_in_flight"] = max_in_flight
    assert specs([b], workers, adaptive).get("r") == expected


def test_a_split_route_queues_at_its_backends_together() -> None:
    bs = [{"name": n, "endpoints": TWO[:1], "max_in_flight": 4} for n in ("a", "b")]
    routes = [{"name": "r", "backends": [{"backend": "a", "weight": 90},
                                         {"backend": "b", "weight": 10}]}]  # fmt: skip
    assert specs(bs, routes=routes)["r"] == PoolSpec("a+b", 8, (("a", 4), ("b", 4)), 1, 8)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2", 2.0),
        ("0.5", 0.5),
        ("0", 1.0),
        ("-3", 1.0),
        ("nan", 1.0),
        ("lots", 1.0),
        (None, 1.0),
        ("1e9", 1.0),
    ],
)
def test_weights_from_a_header_fall_back_to_the_default(value: str | None, expected: float) -> None:
    w = Weight("header:X-Weight", 1.0)
    assert w.of({"x-weight": value} if value is not None else {}, None) == expected
