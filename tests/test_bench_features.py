"""`sluice bench --full`'s paired feature costs (`gateway.bench.features`): the median of the
pairs' differences, their spread, and pairs with a failed run left out."""

from __future__ import annotations

from gateway.bench.features import pair_cost, scaled_budget


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


def test_with_the_runs_floor_the_budget_scales_with_it() -> None:
    """A budget is µs at the reference floor (17.6 µs): a machine whose floor costs twice as
    much gets twice the µs, and the verdict is read against that."""
    cost = pair_cost([50.0, 48.0, 53.0], [46.0, 45.5, 44.0])  # +4.0
    assert cost is not None
    assert scaled_budget(3.0, 35.2) == 6.0
    slow = cost.note("auth", "native", 3.0, floor_us=35.2)
    assert slow.endswith("budget ≤ 3 at a 17.6 µs floor = ≤ 6.0 at this run's 35.2: within")
    fast = cost.note("auth", "native", 3.0, floor_us=17.6)
    assert fast.endswith("= ≤ 3.0 at this run's 17.6: OVER")
