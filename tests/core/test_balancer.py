"""Smooth weighted round robin: exact shares over a cycle, even interleaving, zero weights."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest

from gateway.core.balancer import SmoothWeightedRoundRobin


def picks(weights: Sequence[float], n: int) -> list[int | None]:
    rr = SmoothWeightedRoundRobin(weights)
    return [rr.pick() for _ in range(n)]


@pytest.mark.parametrize(
    ("weights", "cycles"),
    [
        ([1], 3),
        ([1, 1], 3),
        ([5, 1, 1], 4),
        ([3, 2], 5),
        ([1, 2, 3, 4], 2),
        ([95, 5], 2),
        ([0, 4, 0, 1], 3),
        ([7, 0], 2),
        ([10000, 1], 1),
    ],
)
def test_each_cycle_gives_exact_shares(weights: list[int], cycles: int) -> None:
    rr = SmoothWeightedRoundRobin(weights)
    total = sum(weights)
    for _ in range(cycles):
        got = Counter(rr.pick() for _ in range(total))
        assert got == Counter({i: w for i, w in enumerate(weights) if w > 0})


@pytest.mark.parametrize(
    ("weights", "expected"),
    [
        # nginx's documented sequence for weights 5, 1, 1: a a b a c a a
        ([5, 1, 1], [0, 0, 1, 0, 2, 0, 0]),
        ([1, 1], [0, 1, 0, 1]),
        ([2, 1], [0, 1, 0, 0, 1, 0]),
        ([0, 1], [1, 1, 1]),
    ],
)
def test_interleaving_sequence(weights: list[int], expected: list[int]) -> None:
    assert picks(weights, len(expected)) == expected


@pytest.mark.parametrize("weights", [[0, 3, 0], [0, 1, 2], [4, 0]])
def test_zero_weight_never_picked(weights: list[int]) -> None:
    zero = {i for i, w in enumerate(weights) if w == 0}
    assert not zero & set(picks(weights, 1000))


@pytest.mark.parametrize("weights", [[], [0], [0, 0, 0], [-1, 0]])
def test_nothing_to_pick_returns_none(weights: list[float]) -> None:
    assert picks(weights, 3) == [None, None, None]


def test_no_peer_runs_ahead_of_its_share() -> None:
    # Smoothness: after any prefix of k picks, each peer is within 1 of k * w / total.
    weights = [5, 3, 2]
    rr = SmoothWeightedRoundRobin(weights)
    got: Counter[int | None] = Counter()
    for k in range(1, 101):
        got[rr.pick()] += 1
        for i, w in enumerate(weights):
            assert abs(got[i] - k * w / 10) < 1.0 + 1e-9


def test_fractional_weights() -> None:
    got = Counter(picks([0.5, 1.5], 400))
    assert got == Counter({0: 100, 1: 300})


# --- the pick_with variant: weights given per pick -------------------------------------------
def test_pick_with_follows_changing_weights() -> None:
    rr = SmoothWeightedRoundRobin([9, 1])
    assert Counter(rr.pick_with([9, 1]) for _ in range(100)) == Counter({0: 90, 1: 10})
    assert Counter(rr.pick_with([9, 0]) for _ in range(10)) == Counter({0: 10})
    assert rr.pick_with([0, 0]) is None
