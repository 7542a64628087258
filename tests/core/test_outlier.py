"""Outlier ejection: timeout ratio over a sliding window, minimum count, ejection time that
grows with each ejection, and the share of members that may be out at once."""

from __future__ import annotations

import pytest

from gateway.core.outlier import Outlier, OutlierParams, max_ejected

P = OutlierParams(timeout_ratio=0.15, window_s=120.0, min_requests=20, max_ejected=0.5,
                  ejection_s=30.0, max_ejection_s=75.0)  # fmt: skip


def feed(o: Outlier, now: float, ok: int, timeouts: int) -> bool:
    wants = False
    for _ in range(ok):
        wants = o.record(now, False) or wants
    for _ in range(timeouts):
        wants = o.record(now, True) or wants
    return wants


@pytest.mark.parametrize(
    ("ok", "timeouts", "ejects"),
    [
        (17, 3, False),  # 15 %: not above
        (16, 4, True),  # 20 %
        (10, 3, False),  # 23 % but only 13 results (< min_requests)
        (0, 20, True),
        (100, 15, False),  # 13 %
    ],
)
def test_timeout_ratio_with_minimum(ok: int, timeouts: int, ejects: bool) -> None:
    assert feed(Outlier(P), 0.0, ok, timeouts) is ejects


def test_window_slides_over_two_minutes() -> None:
    o = Outlier(P)
    feed(o, 0.0, 0, 10)  # 10 timeouts at t=0
    assert not feed(o, 130.0, 20, 1)  # at t=130 they have left the window: 1 of 21


def test_ejection_time_grows_and_is_capped() -> None:
    o = Outlier(P)
    assert o.eject(0.0) == 30.0
    assert o.ejected(29.9) and not o.ejected(30.0)
    assert o.eject(100.0) == 160.0  # second ejection: 2 × 30 s
    assert o.eject(200.0) == 275.0  # third: 90 s, capped at 75 s
    assert o.next_deadline(210.0) == 275.0


def test_an_ejected_member_does_not_ask_again_and_starts_fresh() -> None:
    o = Outlier(P)
    assert feed(o, 0.0, 0, 20)
    o.eject(0.0)
    assert not feed(o, 10.0, 0, 30)  # still ejected: no new request for ejection
    assert not feed(o, 31.0, 20, 0)  # back, fresh window


@pytest.mark.parametrize(
    ("share", "members", "allowed"),
    [(0.5, 4, 2), (0.1, 4, 1), (0.1, 30, 3), (0.0, 3, 1), (1.0, 3, 3), (0.5, 0, 0), (0.5, 1, 1)],
)
def test_max_ejected_is_at_least_one(share: float, members: int, allowed: int) -> None:
    assert max_ejected(OutlierParams(max_ejected=share), members) == allowed
