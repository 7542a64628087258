"""The rollout stage machine and the old-vs-new judgement, with hand-made statistics."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.core.rollout import (
    SHADOW,
    Event,
    Phase,
    Plan,
    ShadowStats,
    ShareStats,
    State,
    is_failure,
    judge_serving,
    judge_shadow,
    share_of,
    start,
    step,
)

PLAN = Plan((SHADOW, 5.0, 25.0, 100.0), hold_s=10.0, min_requests=20)


def stats(n: int, errors: int = 0, latency: float = 0.02) -> ShareStats:
    s = ShareStats()
    for i in range(n):
        s.add(latency, i < errors)
    return s


def test_stages_advance_to_complete() -> None:
    s = start(PLAN, 0.0)
    assert (s.phase, s.index, share_of(PLAN, s)) == (Phase.SHADOW, 0, 0.0)
    shares = []
    for t in (1.0, 2.0, 3.0, 4.0):
        s = step(PLAN, s, Event.PASSED, t)
        shares.append(share_of(PLAN, s))
    assert shares == [5.0, 25.0, 100.0, 100.0]
    assert s.phase is Phase.COMPLETE and s.terminal


def test_breach_rolls_back_and_abort_stops() -> None:
    s = step(PLAN, start(PLAN, 0.0), Event.PASSED, 1.0)
    rolled = step(PLAN, s, Event.BREACHED, 2.0, "errors")
    assert rolled.phase is Phase.ROLLED_BACK and rolled.reason == "errors"
    assert share_of(PLAN, rolled) == 0.0
    assert step(PLAN, s, Event.ABORT, 2.0).phase is Phase.ABORTED


@given(st.sampled_from(list(Phase)), st.sampled_from(list(Event)), st.integers(0, 3))
def test_terminal_phases_ignore_every_event(phase: Phase, event: Event, index: int) -> None:
    s = State(phase, index, 0.0)
    after = step(PLAN, s, event, 1.0)
    if s.terminal:
        assert after is s
    else:
        assert after.index >= s.index  # stages never go backwards
        assert after.phase is not Phase.SHADOW or after.index == 0


def test_shadow_waits_for_traffic_then_passes_after_hold() -> None:
    sh = ShadowStats()
    for _ in range(10):
        sh.add("route:a", "route:a", False, False)
    assert judge_shadow(PLAN, sh, 100.0).event is None  # 10 < min_requests
    for _ in range(10):
        sh.add("route:a", "route:b", False, False)
    assert judge_shadow(PLAN, sh, 5.0).event is None  # holding
    assert judge_shadow(PLAN, sh, 10.0).event is Event.PASSED
    assert sh.summary()["changes"] == [{"old": "route:a", "new": "route:b", "requests": 10}]


def test_shadow_breaches_when_the_new_policy_would_refuse_more() -> None:
    sh = ShadowStats()
    for i in range(40):
        sh.add("route:a", "no_route" if i % 2 else "route:a", False, i % 2 == 1)
    j = judge_shadow(PLAN, sh, 1.0)
    assert j.event is Event.BREACHED
    assert "would refuse 50.0%" in j.reason


def test_serving_breach_on_error_rate() -> None:
    j = judge_serving(PLAN, stats(400), stats(20, errors=20), ShareStats(), 1.0)
    assert j.event is Event.BREACHED
    assert "100.0% vs 0.0%" in j.reason
    # The same errors on both sides are the backend's, not the policy's.
    j = judge_serving(PLAN, stats(400, errors=200), stats(20, errors=10), ShareStats(), 1.0)
    assert j.event is None


def test_a_certain_breach_is_called_before_min_requests() -> None:
    # One failure: even if the next 19 succeed, 1/20 = 5 % > 0 % + 2 %.
    j = judge_serving(PLAN, stats(400), stats(2, errors=1), ShareStats(), 0.1)
    assert j.event is Event.BREACHED
    assert judge_serving(PLAN, stats(400), stats(2, errors=0), ShareStats(), 0.1).event is None
    # Not certain while the old side fails as often: 1/20 - 10 % < 2 %.
    assert judge_serving(PLAN, stats(400, 40), stats(2, errors=1), ShareStats(), 0.1).event is None
    # Without a reference (no old-side data yet) it waits for min_requests.
    assert judge_serving(PLAN, stats(3), stats(2, errors=2), ShareStats(), 0.1).event is None
    sh = ShadowStats()
    sh.add("route:a", "route:a", False, False)
    assert judge_shadow(PLAN, sh, 0.1).event is None
    sh.add("route:a", "no_route", False, True)
    assert judge_shadow(PLAN, sh, 0.1).event is Event.BREACHED


def test_serving_breach_on_p95() -> None:
    slow = stats(30, latency=1.0)
    j = judge_serving(PLAN, stats(400, latency=0.02), slow, ShareStats(), 1.0)
    assert j.event is Event.BREACHED and "p95" in j.reason
    # Within ratio × old + slack: fine.
    ok = stats(30, latency=0.04)
    assert judge_serving(PLAN, stats(400, latency=0.02), ok, ShareStats(), 11.0).event is (
        Event.PASSED
    )


def test_serving_at_100_percent_compares_with_the_baseline() -> None:
    baseline = stats(500)
    j = judge_serving(PLAN, ShareStats(), stats(25, errors=5), baseline, 1.0)
    assert j.event is Event.BREACHED
    assert judge_serving(PLAN, ShareStats(), stats(25), baseline, 10.0).event is Event.PASSED


def test_a_stage_never_passes_without_traffic() -> None:
    j = judge_serving(PLAN, stats(400), stats(3), ShareStats(), 1000.0)
    assert j.event is None and "waiting for traffic" in j.reason


def test_what_counts_as_a_failure() -> None:
    assert is_failure(False, 502, None, False)
    assert is_failure(False, 503, None, True)  # no endpoint
    assert is_failure(False, 404, None, True)  # Sluice's no route
    assert not is_failure(False, 404, None, False)  # the backend's own 404
    assert is_failure(False, 413, None, True)
    assert not is_failure(False, 429, None, True)  # a limit is not an outage
    assert not is_failure(False, 200, None, False)
    assert is_failure(True, 0, 14, False)  # UNAVAILABLE
    assert is_failure(True, 0, None, False)  # ended without a status: UNKNOWN
    assert not is_failure(True, 0, 16, True)  # UNAUTHENTICATED
    assert not is_failure(True, 0, 0, False)
