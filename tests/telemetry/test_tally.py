"""Tallies give the same exposition as updating the Prometheus children directly."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.telemetry import tally
from gateway.telemetry.tally import CountTally, HistTally

BUCKETS = (0.001, 0.01, 0.1, 1.0)
# On a bucket bound, between bounds, below the first, past the last, zero.
AMOUNTS = [0.001, 0.0005, 0.01, 0.05, 0.1, 2.0, 1.0, 0.0, 7.5, 0.02]


def exposed(reg: CollectorRegistry) -> list[bytes]:
    """The exposition without the `_created` timestamps (when each child was made)."""
    return [line for line in generate_latest(reg).splitlines() if b"_created" not in line]


def pair(kind: str) -> tuple[CollectorRegistry, CollectorRegistry, object, object]:
    regs = CollectorRegistry(), CollectorRegistry()
    made = []
    for reg in regs:
        if kind == "hist":
            made.append(Histogram("x", "x", ["r"], buckets=BUCKETS, registry=reg).labels("a"))
        else:
            made.append(Counter("x", "x", ["r"], registry=reg).labels("a"))
    return regs[0], regs[1], made[0], made[1]


def test_histogram_tally_exposes_what_direct_observations_expose() -> None:
    direct_reg, tallied_reg, direct, child = pair("hist")
    t = HistTally(child)
    for a in AMOUNTS:
        direct.observe(a)  # type: ignore[attr-defined]
        t.observe(a)
    assert exposed(tallied_reg) != exposed(direct_reg)  # nothing moved yet
    tally.flush()
    assert exposed(tallied_reg) == exposed(direct_reg)
    for a in AMOUNTS[:3]:  # a second batch adds to the first
        direct.observe(a)  # type: ignore[attr-defined]
        t.observe(a)
    tally.flush()
    tally.flush()  # nothing pending: no change
    assert exposed(tallied_reg) == exposed(direct_reg)


def test_counter_tally_exposes_what_direct_increments_expose() -> None:
    direct_reg, tallied_reg, direct, child = pair("counter")
    t = CountTally(child)
    for n in (1, 1, 5, 0.5):
        direct.inc(n)  # type: ignore[attr-defined]
        t.inc(n)
    tally.flush()
    assert exposed(tallied_reg) == exposed(direct_reg)
    assert b'x_total{r="a"} 7.5' in generate_latest(tallied_reg)


def test_an_observation_with_an_exemplar_reaches_the_child_at_once() -> None:
    _, tallied_reg, _, child = pair("hist")
    t = HistTally(child)
    t.observe(0.05, {"trace_id": "ab" * 16})
    assert b'x_count{r="a"} 1.0' in generate_latest(tallied_reg)
