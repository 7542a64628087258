"""Colours: bands, the (colour, band) table, hysteresis over sequences, shedding by class."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.overload import (
    _TRANSITIONS,
    Band,
    Colour,
    ColourMachine,
    History,
    Thresholds,
    sheds,
    step,
)

G, Y, R = Colour.GREEN, Colour.YELLOW, Colour.RED
TH = Thresholds()


@pytest.mark.parametrize(
    ("a", "b", "band"),
    [
        (0.0, 0.0, Band.LOW),
        (0.79, 0.5, Band.LOW),
        (0.80, 0.0, Band.HOLD),
        (0.85, 0.85, Band.HOLD),
        (0.86, 0.2, Band.HIGH),
        (0.2, 0.86, Band.HIGH),
        (0.99, 0.85, Band.HIGH),
        (0.9, 0.9, Band.BOTH),
        (0.99, 0.95, Band.BOTH),
        (0.96, 0.96, Band.CRITICAL),
        (3.0, 1.2, Band.CRITICAL),
    ],
)
def test_band(a: float, b: float, band: Band) -> None:
    assert TH.band(a, b) is band


@pytest.mark.parametrize(
    ("colour", "band", "expected"),
    [
        (G, Band.LOW, G), (G, Band.HOLD, G), (G, Band.HIGH, Y), (G, Band.BOTH, Y),
        (G, Band.CRITICAL, R),
        (Y, Band.LOW, G), (Y, Band.HOLD, Y), (Y, Band.HIGH, Y), (Y, Band.BOTH, Y),
        (Y, Band.CRITICAL, R),
        (R, Band.LOW, G), (R, Band.HOLD, Y), (R, Band.HIGH, Y), (R, Band.BOTH, R),
        (R, Band.CRITICAL, R),
    ],
)  # fmt: skip
def test_every_transition(colour: Colour, band: Band, expected: Colour) -> None:
    assert step(colour, band) is expected
    assert _TRANSITIONS.get((colour, band), colour) is expected


@pytest.mark.parametrize(
    ("signals", "colours"),
    [
        # Up through the bands, and the hold band keeps yellow on the way down.
        (
            [(0.5, 0.5), (0.9, 0.1), (0.83, 0.1), (0.81, 0.81), (0.7, 0.7)],
            [G, Y, Y, Y, G],
        ),
        # The hold band does not turn a green key yellow.
        ([(0.84, 0.84), (0.82, 0.0), (0.5, 0.5)], [G, G, G]),
        # Red needs both signals; it holds while both stay above yellow.
        (
            [(0.99, 0.5), (0.99, 0.97), (0.9, 0.9), (0.99, 0.86), (0.99, 0.8), (0.1, 0.1)],
            [Y, R, R, R, Y, G],
        ),
        # Straight from green to red, and back.
        ([(1.2, 1.1), (0.1, 0.2)], [R, G]),
    ],
)
def test_hysteresis_sequences(signals: list[tuple[float, float]], colours: list[Colour]) -> None:
    m = ColourMachine()
    seen = []
    for i, (a, b) in enumerate(signals):
        m.update(TH.band(a, b), float(i))
        seen.append(m.colour)
    assert seen == colours


def test_update_reports_changes_only() -> None:
    m = ColourMachine(0.0)
    assert m.update(Band.HIGH, 1.0) is Y and m.since == 1.0
    assert m.update(Band.HIGH, 2.0) is None and m.since == 1.0


@given(st.sampled_from(Colour), st.sampled_from(Band))
def test_table_invariants(colour: Colour, band: Band) -> None:
    new = step(colour, band)
    if band is Band.LOW:
        assert new is G  # both signals low always means green
    if band is Band.CRITICAL:
        assert new is R
    if band in (Band.HIGH, Band.BOTH):
        assert new is not G  # a high signal is never green
    if band is Band.HOLD:
        assert new is (G if colour is G else Y)  # between the bands: hold (red steps down)


@pytest.mark.parametrize(
    ("colour", "priority", "top", "lowest", "shed"),
    [
        (G, 2, 0, 2, False),
        (Y, 2, 0, 2, True),  # yellow sheds the lowest class first
        (Y, 1, 0, 2, False),
        (Y, 0, 0, 2, False),
        (Y, 5, 0, 2, True),  # unknown (beyond lowest) counts as lowest
        (R, 2, 0, 2, True),
        (R, 1, 0, 2, True),  # red sheds everything but the top class
        (R, 0, 0, 2, False),
        (R, 0, 0, 0, False),  # one class: nothing is shed by colour
        (Y, 0, 0, 0, False),
    ],
)
def test_sheds(colour: Colour, priority: int, top: int, lowest: int, shed: bool) -> None:
    assert sheds(colour, priority, top, lowest) is shed


def test_history_keeps_the_worst_colour_per_second_for_a_bounded_time() -> None:
    h = History(seconds=3)
    h.note(G, 10.1)
    h.note(R, 10.5)
    h.note(Y, 10.9)
    h.note(Y, 11.2)
    assert h.series(11.5) == [(1, "red"), (0, "yellow")]
    for s in range(12, 20):
        h.note(G, float(s))
    assert [ago for ago, _ in h.series(19.0)] == [2, 1, 0]
    assert len(h._slots) <= 4
