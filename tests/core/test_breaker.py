"""Circuit breaker: the transition table, trip conditions, half-open probes, back-off; and,
with hypothesis over (state, event) sequences, the invariants that must always hold."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.breaker import (
    JITTER,
    REFUSED,
    TRANSITIONS,
    Breaker,
    BreakerParams,
    Event,
    State,
)
from gateway.core.clock import ManualClock

P = BreakerParams(
    consecutive_failures=5,
    error_ratio=0.5,
    slow_call_s=1.0,
    slow_ratio=0.5,
    min_requests=10,
    window_s=10.0,
    open_s=5.0,
    max_open_s=40.0,
    half_open_probes=2,
    probe_timeout_s=3.0,
)


def mid() -> float:
    return 0.5  # jitter factor 1.0 exactly


def run(b: Breaker, clock: ManualClock, script: str) -> list[str]:
    """Drive `b` with a script: `s` success, `f` failure, `w` slow success, `+N` advance N s,
    `a` an admission that is kept open (its ticket remembered), `A` report the oldest kept as
    success, `F` as failure. Returns the state after each step."""
    states: list[str] = []
    kept: list[int] = []
    for step in script.split():
        if step.startswith("+"):
            clock.t += float(step[1:])
            b.tick(clock.t)
        elif step == "a":
            kept.append(b.allow(clock.t))
        elif step in ("A", "F"):
            b.record(kept.pop(0), clock.t, step == "F", False)
        else:
            t = b.allow(clock.t)
            if t != REFUSED:
                b.record(t, clock.t, step == "f", step == "w")
        states.append(b.state.value[0])  # c / o / h
    return states


@pytest.mark.parametrize(
    ("script", "final"),
    [
        ("f f f f", State.CLOSED),  # below consecutive_failures
        ("f f f f f", State.OPEN),  # 5 in a row
        ("f f f f s f f f f", State.CLOSED),  # a success resets the run
        # error ratio: 10 requests, 5 failed, never 5 in a row
        ("f s f s f s f s f s", State.OPEN),
        ("f s f s f s f s s s", State.CLOSED),  # 4 of 10
        ("f s f s f s f s", State.CLOSED),  # 4 of 8: below min_requests
        # slow calls: 5 of 10 slower than slow_call_s
        ("w s w s w s w s w s", State.OPEN),
        ("w s w s w s w s s s", State.CLOSED),
        # the window slides: old failures leave it
        ("f s f s f s f +11 s s s s s s s s s f", State.CLOSED),
    ],
)
def test_trip_conditions(script: str, final: State) -> None:
    clock = ManualClock()
    b = Breaker(P, mid)
    run(b, clock, script)
    assert b.state is final


@pytest.mark.parametrize(
    ("script", "states"),
    [
        # open 5 s, then half-open; two good probes close it
        ("f f f f f +4.9 s +0.2 s s", "cccco o o h h c"),
        # a failed probe re-opens it, for twice as long (10 s)
        ("f f f f f +5 s f +9.9 s +0.2 s", "cccco h h o o o h h"),
        # a slow probe counts as a failure
        ("f f f f f +5 w", "cccco h o"),
    ],
)
def test_open_half_open_sequences(script: str, states: str) -> None:
    clock = ManualClock()
    b = Breaker(P, mid)
    assert "".join(run(b, clock, script)) == states.replace(" ", "")


def test_open_refuses_until_cooldown_then_admits_bounded_probes() -> None:
    clock = ManualClock()
    b = Breaker(P, mid)
    run(b, clock, "f f f f f")
    assert b.allow(clock.t + 4.99) == REFUSED
    clock.t += 5.0
    t1, t2, t3 = b.allow(clock.t), b.allow(clock.t), b.allow(clock.t)
    assert b.state is State.HALF_OPEN
    assert t1 != REFUSED and t2 != REFUSED and t3 == REFUSED  # half_open_probes = 2
    b.record(t1, clock.t, False, False)
    assert b.state is State.HALF_OPEN and b.allow(clock.t) == REFUSED
    b.record(t2, clock.t, False, False)
    assert b.state is State.CLOSED


def test_a_hanging_probe_times_out_and_reopens() -> None:
    clock = ManualClock()
    b = Breaker(P, mid)
    run(b, clock, "f f f f f +5")
    probe = b.allow(clock.t)
    assert b.state is State.HALF_OPEN and probe != REFUSED
    assert b.next_deadline() == pytest.approx(clock.t + P.probe_timeout_s)
    clock.t += P.probe_timeout_s - 0.01
    assert b.tick(clock.t) is None and b.state is State.HALF_OPEN
    clock.t += 0.02
    change = b.tick(clock.t)
    assert change is not None and change.new is State.OPEN and "unanswered" in change.reason
    # the late answer of the hung probe changes nothing
    assert b.record(probe, clock.t, False, False) is None
    assert b.state is State.OPEN


def test_stale_tickets_are_ignored() -> None:
    clock = ManualClock()
    b = Breaker(P, mid)
    early = b.allow(0.0)  # admitted while closed, answers after the trip
    run(b, clock, "f f f f f +5")
    assert b.state is State.HALF_OPEN
    assert b.record(early, clock.t, False, False) is None
    assert b.probes_ok == 0


def test_ignored_probe_frees_its_slot() -> None:
    clock = ManualClock()
    b = Breaker(P, mid)
    run(b, clock, "f f f f f +5")
    t1, t2 = b.allow(clock.t), b.allow(clock.t)
    assert b.allow(clock.t) == REFUSED
    b.ignore(t1)  # the client went away
    t3 = b.allow(clock.t)
    assert t3 != REFUSED
    b.record(t2, clock.t, False, False)
    b.record(t3, clock.t, False, False)
    assert b.state is State.CLOSED


@pytest.mark.parametrize(
    ("reopens", "base"), [(0, 5.0), (1, 10.0), (2, 20.0), (3, 40.0), (4, 40.0), (9, 40.0)]
)
@pytest.mark.parametrize("u", [0.0, 0.5, 0.999])
def test_open_time_backs_off_with_jitter(reopens: int, base: float, u: float) -> None:
    b = Breaker(P, lambda: u)
    b.reopens = reopens
    run(b, ManualClock(), "f f f f f")
    assert b.open_until == pytest.approx(base * (1 + JITTER * (2 * u - 1)))


def test_close_resets_back_off() -> None:
    clock = ManualClock()
    b = Breaker(P, mid)
    run(b, clock, "f f f f f +5 f +10 s s")  # opened twice, then closed
    assert b.state is State.CLOSED and b.reopens == 0
    run(b, clock, "f f f f f")
    assert b.open_until == pytest.approx(clock.t + 5.0)


def test_transition_table_is_the_documented_one() -> None:
    assert TRANSITIONS == {
        (State.CLOSED, Event.TRIPPED): State.OPEN,
        (State.OPEN, Event.COOLDOWN_ELAPSED): State.HALF_OPEN,
        (State.HALF_OPEN, Event.PROBE_OK): State.CLOSED,
        (State.HALF_OPEN, Event.PROBE_FAILED): State.OPEN,
    }


# --- hypothesis: random sequences of events keep the invariants -------------------------------

ACTIONS = st.sampled_from(["ok", "fail", "slow", "ignore", "admit", "wait", "tick"])


@settings(max_examples=300, deadline=None, database=None)
@given(
    st.lists(st.tuples(ACTIONS, st.floats(0, 20, allow_nan=False)), max_size=80),
    st.floats(0, 0.999),
)
def test_invariants_over_random_sequences(steps: list[tuple[str, float]], u: float) -> None:
    b = Breaker(P, lambda: u)
    now = 0.0
    held: list[int] = []
    for action, x in steps:
        before = b.state
        if action == "wait":
            now += x
        elif action == "tick":
            b.tick(now)
        elif action == "admit":
            t = b.allow(now)
            if before is State.OPEN and now < b.open_until:
                assert t == REFUSED  # open refuses until its time is up
            if t != REFUSED:
                held.append(t)
        elif held:
            t = held.pop(int(x) % len(held))
            if action == "ignore":
                b.ignore(t)
            else:
                b.record(t, now, action == "fail", action == "slow")
        # Invariants
        assert b.state in State
        if b.state is State.HALF_OPEN:
            pending = sum(b.probe_open)
            assert 0 <= b.probes_started <= P.half_open_probes
            assert pending <= b.probes_started
            # never stuck: every pending probe has a deadline within probe_timeout_s
            assert b.next_deadline() <= now + P.probe_timeout_s or pending == 0
        if b.state is State.OPEN:
            length = b.open_until - now
            assert length <= P.max_open_s * (1 + JITTER) + 1e-9
        if b.state is State.CLOSED:
            assert b.allow(now) != REFUSED


@settings(max_examples=200, deadline=None, database=None)
@given(st.sampled_from(list(State)), st.sampled_from(list(Event)))
def test_every_state_event_pair_has_a_defined_next_state(state: State, event: Event) -> None:
    nxt = TRANSITIONS.get((state, event), state)
    assert nxt in State
    # CLOSED is only left by a trip; OPEN only by its cool-down
    if state is State.CLOSED and event is not Event.TRIPPED:
        assert nxt is State.CLOSED
    if state is State.OPEN and event is not Event.COOLDOWN_ELAPSED:
        assert nxt is State.OPEN


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(st.sampled_from(["admit", "ok", "fail"]), max_size=40))
def test_half_open_never_stuck_with_time(steps: list[str]) -> None:
    """Whatever happens half-open, once every probe's deadline has passed the breaker has left
    half-open or has a free probe slot (it can always make progress)."""
    b = Breaker(P, mid)
    run(b, ManualClock(), "f f f f f")
    now = 5.0
    b.tick(now)
    held: list[int] = []
    for s in steps:
        if s == "admit":
            t = b.allow(now)
            if t != REFUSED:
                held.append(t)
        elif held:
            b.record(held.pop(0), now, s == "fail", False)
        now += 0.5
    deadline = b.next_deadline()
    later = (deadline if deadline != math.inf else now) + 0.001
    b.tick(later)
    assert b.state is not State.HALF_OPEN or b.admits(later)
