"""`sluice bench --full`'s paired feature costs (`gateway.bench.features`): the median of the
pairs' differences, their spread, and pairs with a failed run left out."""

from __future__ import annotations

from gateway.bench.features import pair_cost


def test_the_cost_is_the_median_of_the_pairs_differences() -> None:
    cost = pair_cost([50.0, 48.0, 53.0], [46.0, 45.5, 44.0])
    assert cost is not None
    assert (cost.median, cost.low, cost.high, cost.pairs) == (4.0, 2.5, 9.0, 3)
    assert "+4.0 µs/req, the median of 3 pairs" in cost.note("auth", "native", 3.0)
    assert cost.note("auth", "native", 3.0).endswith("budget ≤ 3: OVER")
    assert cost.note("auth", "native", 5.0).endswith("budget ≤ 5: within")


def test_a_pair_with_a_failed_run_is_left_out() -> None:
    cost = pair_cost([50.0, 0.0, 49.0], [45.0, 44.0, 0.0])
    assert cost is not None and (cost.median, cost.pairs) == (5.0, 1)
    assert pair_cost([0.0], [44.0]) is None
