"""The SLO-anchored gradient limit, driven by hand (latency samples and a manual clock)."""

from __future__ import annotations

import pytest

from gateway.core.concurrency import UPDATE_S, GradientLimit, LimitParams

P = LimitParams(slo_s=0.5, initial=20, min_limit=4, max_limit=100, smoothing=0.5)


def drive(g: GradientLimit, latency: float, in_flight: int, rounds: int, t0: float = 0.0) -> float:
    t = t0
    for _ in range(rounds):
        for _ in range(in_flight):
            g.start()
        t += UPDATE_S
        for _ in range(in_flight):
            g.finish(latency, t)
    return t


@pytest.mark.parametrize(
    ("latency", "in_flight", "direction"),
    [
        (2.0, 20, "down"),  # 4x the SLO: shrink
        (0.5, 20, "same"),  # at the SLO: hold
        (0.1, 20, "up"),  # well under and using the limit: grow
        (0.1, 2, "same"),  # under, but idle: no evidence that more would be fine
    ],
)
def test_limit_follows_latency_against_the_slo(
    latency: float, in_flight: int, direction: str
) -> None:
    g = GradientLimit(P)
    drive(g, latency, in_flight, 3)
    if direction == "down":
        assert g.limit < 20
    elif direction == "up":
        assert g.limit > 20
    else:
        assert g.limit == pytest.approx(20)


def test_limit_stays_within_bounds() -> None:
    g = GradientLimit(P)
    drive(g, 10.0, 20, 50)
    assert g.limit == P.min_limit
    g2 = GradientLimit(P)
    drive(g2, 0.01, 100, 60)
    assert g2.limit == P.max_limit


def test_refused_requests_give_no_sample() -> None:
    g = GradientLimit(P)
    g.start()
    g.finish(None, 10.0)
    assert g.in_flight == 0 and g.samples == 0 and g.limit == 20


def test_utilisation_and_in_flight_never_negative() -> None:
    g = GradientLimit(P)
    for _ in range(10):
        g.start()
    assert g.utilisation == 0.5
    for _ in range(12):
        g.finish(None, 0.0)
    assert g.in_flight == 0
