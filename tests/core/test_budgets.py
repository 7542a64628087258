from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from gateway.core.budgets import (
    Cost,
    Ledger,
    Period,
    Weights,
    cost,
    crossed,
    level,
    parse_duration,
    share_plan,
    window,
)


def ts(text: str, tz: str = "UTC") -> float:
    return datetime.fromisoformat(text).replace(tzinfo=ZoneInfo(tz)).timestamp()


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("10s", 10), ("15m", 900), ("12h", 43200), ("30d", 2592000), ("2w", 1209600)],
)
def test_durations(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["0s", "10", "s", "1.5h", "10y", "-1d", ""])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


def test_rolling_10s_resets_exactly_at_its_edge() -> None:
    p = Period(rolling_s=10)
    edge = 1_800_000_000.0
    before, at = window(p, edge - 1e-6), window(p, edge)
    assert before.end == edge and at.start == edge
    assert before.id != at.id
    assert window(p, edge + 9.999).id == at.id
    assert window(p, edge + 10).id != at.id


def test_calendar_day_resets_exactly_at_midnight() -> None:
    p = Period(calendar="day", timezone="UTC")
    midnight = ts("2026-12-06T00:00:00")
    last = window(p, midnight - 0.001)
    first = window(p, midnight)
    assert last.id == "d2026-12-05" and last.end == midnight
    assert first.id == "d2026-12-06" and first.start == midnight
    assert first.end == midnight + 86400


def test_calendar_day_in_a_time_zone_with_daylight_saving() -> None:
    p = Period(calendar="day", timezone="Europe/Paris")
    # 2026-03-29: clocks go forward at 02:00, the day is 23 hours long.
    w = window(p, ts("2026-03-29T12:00:00", "Europe/Paris"))
    assert w.id == "d2026-03-29"
    assert w.start == ts("2026-03-29T00:00:00", "Europe/Paris")
    assert w.end - w.start == 23 * 3600
    assert window(p, w.end).id == "d2026-03-30"
    assert window(p, w.end - 0.001).id == "d2026-03-29"


def test_calendar_week_starts_on_monday() -> None:
    p = Period(calendar="week")
    w = window(p, ts("2026-12-05T10:00:00"))  # a Saturday
    assert w.id == "w2026-11-30"
    assert w.start == ts("2026-11-30T00:00:00") and w.end == ts("2026-12-07T00:00:00")


@pytest.mark.parametrize(
    ("now", "ident", "end"),
    [
        ("2026-12-31T23:59:59", "m2026-12", "2027-01-01T00:00:00"),
        ("2027-01-01T00:00:00", "m2027-01", "2027-02-01T00:00:00"),
        ("2028-02-15T00:00:00", "m2028-02", "2028-03-01T00:00:00"),
    ],
)
def test_calendar_month(now: str, ident: str, end: str) -> None:
    w = window(Period(calendar="month"), ts(now))
    assert w.id == ident and w.end == ts(end)


def test_cost_weights_and_models() -> None:
    c = cost(Weights(1, 3), {"big": Weights(2, 6)})
    assert c.of(None, 10, 10) == 40
    assert c.of("other", 10, 10) == 40
    assert c.of("big", 10, 10) == 80
    assert Cost().of(None, 7, 5) == 12
    assert cost(Weights(0.5, 1)).of(None, 3, 0) == 2  # rounded up to a whole token
    assert cost(Weights()).plain and not c.plain


def test_warnings() -> None:
    assert crossed(100, 70, 85, [0.8, 0.95]) == 0.8
    assert crossed(100, 70, 99, [0.8, 0.95]) == 0.95
    assert crossed(100, 80, 90, [0.8, 0.95]) is None  # 80 was already passed
    assert crossed(0, 0, 10, [0.5]) is None
    assert level(100, 96, [0.8, 0.95]) == 0.95
    assert level(100, 10, [0.8]) is None
    assert level(0, 10, [0.8]) is None


def test_ledger_reserves_then_settles_and_refunds() -> None:
    lg = Ledger(1000, window(Period(rolling_s=10), 0))
    assert lg.reserve(600)
    assert not lg.reserve(500)  # does not fit: nothing taken
    assert (lg.avail, lg.reserved) == (400, 600)
    lg.settle(600, 250)  # used less: the rest back
    assert (lg.avail, lg.reserved, lg.used, lg.unreported) == (750, 0, 250, 250)
    assert lg.reserve(750)
    lg.settle(750, 900)  # the backend reported more than reserved: charged in full
    assert lg.used == 1150 and lg.avail == 0 and lg.reserved == 0
    assert not lg.reserve(1)


def test_ledger_overdraft_and_release() -> None:
    lg = Ledger(10, window(Period(rolling_s=10), 0))
    assert lg.reserve(50, overdraft=True)
    assert lg.avail == -40
    lg.release(50)
    assert (lg.avail, lg.reserved, lg.used) == (10, 0, 0)


def test_ledger_overrun_with_others_in_flight() -> None:
    lg = Ledger(100, window(Period(rolling_s=10), 0))
    assert lg.reserve(50) and lg.reserve(50)
    lg.settle(50, 60)
    assert lg.avail == -10 and lg.reserved == 50  # holding 40: not below zero
    lg.settle(50, 50)
    assert lg.avail == 0 and lg.holding == 0 and lg.used == 110


def test_ledger_lost_lease_orphans_reservations() -> None:
    lg = Ledger(100, window(Period(rolling_s=10), 0), avail=0)
    lg.avail = 80
    assert lg.reserve(30)
    epoch = lg.epoch
    lg.lost()
    assert (lg.avail, lg.reserved, lg.orphans) == (0, 0, 30)
    lg.avail = 20  # a new lease
    lg.settle(30, 25, epoch)  # gives nothing back to the new share, usage still reported
    assert (lg.avail, lg.orphans, lg.unreported) == (20, 0, 25)


def test_ledger_adjust_grant_reset() -> None:
    lg = Ledger(100, window(Period(rolling_s=10), 0))
    assert lg.reserve(30)
    lg.settle(30, 30)
    lg.adjust(150)
    assert lg.avail == 120
    lg.add(10)
    assert lg.avail == 130 and lg.grant == 10
    assert lg.reserve(5)
    lg.reset()
    assert lg.used == 0 and lg.grant == 0 and lg.avail == 145 and lg.reserved == 5


@pytest.mark.parametrize(
    ("avail", "target", "idle", "plan"),
    [
        (0, 100, False, (0, 100)),
        (40, 100, False, (0, 60)),
        (60, 100, False, (0, 0)),
        (250, 100, False, (150, 0)),
        (70, 100, True, (70, 0)),
        (-5, 100, True, (0, 0)),
    ],
)
def test_share_plan(avail: int, target: int, idle: bool, plan: tuple[int, int]) -> None:
    assert share_plan(avail, target, idle) == plan
