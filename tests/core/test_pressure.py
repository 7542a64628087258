from __future__ import annotations

import pytest

from gateway.core.pressure import Weights, pressure


@pytest.mark.parametrize(
    ("wq", "wt", "has_q", "has_t", "expected"),
    [
        (0.6, 0.4, True, True, (0.6, 0.4)),
        (0.3, 0.2, True, True, (0.6, 0.4)),  # normalised
        (0.6, 0.4, True, False, (1.0, 0.0)),  # one signal: its weight is the whole score
        (0.6, 0.4, False, True, (0.0, 1.0)),
    ],
)
def test_weights(
    wq: float, wt: float, has_q: bool, has_t: bool, expected: tuple[float, float]
) -> None:
    w = Weights.of(wq, wt, has_q, has_t)
    assert (w.q, w.t) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("q", "t", "score", "admitted"),
    [
        (0.5, 0.5, 0.5, True),
        (1.0, 0.875, 0.95, False),  # exactly at 0.95 is refused (admit while < 0.95)
        (1.0, 0.8, 0.92, True),
        (0.2, 1.0, 0.52, True),  # an empty bucket is refused by the bucket, not the score
        (0.95, 0.95, 0.95, False),
    ],
)
def test_golden_pressure(q: float, t: float, score: float, admitted: bool) -> None:
    p = pressure(q, t, Weights.of(0.6, 0.4, True, True))
    assert p == pytest.approx(score)
    assert (p < 0.95 - 1e-12) is admitted
