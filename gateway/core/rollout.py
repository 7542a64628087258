"""(compiled) Staged rollout of a policy change: the stage machine and the old-vs-new comparison.
Pure.

A plan is a list of stages: `SHADOW` (0: the new policy's decisions are computed beside the
old one's, without effect) then growing percentages of requests served by the new policy, each
held for `hold_s`. `judge` reads the statistics of the stage and returns an event:

- BREACHED when the new share's error rate exceeds the old share's by more than
  `max_error_rate_increase` once it has `min_requests` requests, or earlier, as soon as its
  failures alone make that certain (even if every request up to `min_requests` succeeded); or
  when its p95 exceeds `old p95 × max_p95_ratio + p95_slack_s` (with `min_requests` on both
  sides). Shadow: the share of requests the new policy would refuse and the old one serves,
  against the same allowance;
- PASSED once the stage has lasted `hold_s` and the new share has `min_requests` requests (a
  stage never passes on no data: with little traffic it waits, or an operator promotes it);
- None otherwise.

At 100 % there is no old share left; the comparison uses the old share of the earlier stages
(`baseline`). `step` applies an event through the `(phase, event)` table below; pairs not in
the table leave the state unchanged (terminal phases ignore everything).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any, Final

from gateway.core.histogram import latency_bucket, new_latency_hist, quantile

SHADOW: Final = 0.0  # the stage value of the shadow stage; percentages are (0, 100]
MAX_TRANSITIONS: Final = 64  # distinct (old decision, new decision) pairs kept by the shadow stage


@dataclass(frozen=True, slots=True)
class Plan:
    stages: tuple[float, ...]
    hold_s: float = 60.0
    min_requests: int = 50
    max_error_rate_increase: float = 0.02
    max_p95_ratio: float = 1.5
    p95_slack_s: float = 0.05


class Phase(enum.Enum):
    SHADOW = "shadow"
    SERVING = "serving"  # a percentage of requests goes to the new policy
    COMPLETE = "complete"  # the new policy serves everything
    ROLLED_BACK = "rolled_back"  # a breach sent everything back to the old policy
    ABORTED = "aborted"  # stopped by hand (or superseded by another reload)


class Event(enum.Enum):
    PASSED = "passed"
    BREACHED = "breached"
    PROMOTE = "promote"
    ABORT = "abort"


class Step(enum.Enum):
    ADVANCE = "advance"
    ROLL_BACK = "roll_back"
    STOP = "stop"


_TRANSITIONS: Final[dict[tuple[Phase, Event], Step]] = {
    (Phase.SHADOW, Event.PASSED): Step.ADVANCE,
    (Phase.SHADOW, Event.PROMOTE): Step.ADVANCE,
    (Phase.SHADOW, Event.BREACHED): Step.ROLL_BACK,
    (Phase.SHADOW, Event.ABORT): Step.STOP,
    (Phase.SERVING, Event.PASSED): Step.ADVANCE,
    (Phase.SERVING, Event.PROMOTE): Step.ADVANCE,
    (Phase.SERVING, Event.BREACHED): Step.ROLL_BACK,
    (Phase.SERVING, Event.ABORT): Step.STOP,
}  # COMPLETE, ROLLED_BACK and ABORTED are terminal: no event leaves them


@dataclass(frozen=True, slots=True)
class State:
    phase: Phase
    index: int  # position in plan.stages (len(stages) once complete)
    stage_started: float
    reason: str = ""

    @property
    def terminal(self) -> bool:
        return self.phase in (Phase.COMPLETE, Phase.ROLLED_BACK, Phase.ABORTED)


def _phase_of(stage: float) -> Phase:
    return Phase.SHADOW if stage == SHADOW else Phase.SERVING


def start(plan: Plan, now: float) -> State:
    return State(_phase_of(plan.stages[0]), 0, now)


def step(plan: Plan, state: State, event: Event, now: float, reason: str = "") -> State:
    action = _TRANSITIONS.get((state.phase, event))
    if action is None:
        return state
    if action is Step.ROLL_BACK:
        return replace(state, phase=Phase.ROLLED_BACK, reason=reason)
    if action is Step.STOP:
        return replace(state, phase=Phase.ABORTED, reason=reason)
    index = state.index + 1
    if index >= len(plan.stages):
        return State(Phase.COMPLETE, len(plan.stages), now, reason)
    return State(_phase_of(plan.stages[index]), index, now, reason)


def share_of(plan: Plan, state: State) -> float:
    """Percentage of requests the new policy serves in this state."""
    if state.phase is Phase.COMPLETE:
        return 100.0
    if state.phase is Phase.SERVING:
        return plan.stages[state.index]
    return 0.0


@dataclass(slots=True)
class ShareStats:
    """Requests of one side (old or new policy) in one stage: count, errors, latency."""

    count: int = 0
    errors: int = 0
    hist: list[int] = field(default_factory=new_latency_hist)

    def add(self, seconds: float, error: bool) -> None:
        self.count += 1
        if error:
            self.errors += 1
        self.hist[latency_bucket(seconds)] += 1

    def absorb(self, other: ShareStats) -> None:
        self.count += other.count
        self.errors += other.errors
        for i, n in enumerate(other.hist):
            self.hist[i] += n

    @property
    def error_rate(self) -> float:
        return self.errors / self.count if self.count else 0.0

    def p95(self) -> float | None:
        return quantile(self.hist, 0.95)

    def summary(self) -> dict[str, Any]:
        p95 = self.p95()
        return {
            "requests": self.count,
            "errors": self.errors,
            "error_rate": round(self.error_rate, 4),
            "p95_s": None if p95 is None else round(p95, 4),
        }


@dataclass(slots=True)
class ShadowStats:
    """What the new policy would have decided for requests the old one served."""

    count: int = 0
    old_rejects: int = 0
    new_rejects: int = 0
    changed: int = 0  # decisions that differ (another route, or a refusal)
    transitions: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, old: str, new: str, old_reject: bool, new_reject: bool) -> None:
        self.count += 1
        if old_reject:
            self.old_rejects += 1
        if new_reject:
            self.new_rejects += 1
        if old != new:
            self.changed += 1
            key = (old, new)
            t = self.transitions
            if key in t or len(t) < MAX_TRANSITIONS:
                t[key] = t.get(key, 0) + 1

    def summary(self) -> dict[str, Any]:
        top = sorted(self.transitions.items(), key=lambda kv: -kv[1])[:10]
        return {
            "requests": self.count,
            "old_rejects": self.old_rejects,
            "new_rejects": self.new_rejects,
            "changed": self.changed,
            "changes": [{"old": o, "new": n, "requests": c} for (o, n), c in top],
        }


@dataclass(frozen=True, slots=True)
class Judgement:
    event: Event | None
    reason: str = ""


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def judge_shadow(plan: Plan, shadow: ShadowStats, elapsed: float) -> Judgement:
    # The share of requests the new policy refuses beyond the old one's, at min_requests if
    # every further request were decided alike by both (the plain share once there are more).
    at_min = (shadow.new_rejects - shadow.old_rejects) / max(shadow.count, plan.min_requests)
    if at_min > plan.max_error_rate_increase:
        return Judgement(
            Event.BREACHED,
            f"shadow: the new policy would refuse {_pct(shadow.new_rejects / shadow.count)} of "
            f"requests, the old one {_pct(shadow.old_rejects / shadow.count)} "
            f"(allowed increase {_pct(plan.max_error_rate_increase)}, "
            f"{shadow.count} requests)",
        )
    if shadow.count < plan.min_requests:
        return Judgement(None, f"waiting for traffic ({shadow.count}/{plan.min_requests})")
    if elapsed >= plan.hold_s:
        return Judgement(Event.PASSED, "shadow decisions within bounds")
    return Judgement(None, "holding")


def judge_serving(
    plan: Plan, old: ShareStats, new: ShareStats, baseline: ShareStats, elapsed: float
) -> Judgement:
    """`old`/`new`: this stage's shares; `baseline`: the old share over the whole rollout."""
    ref = old if old.count >= plan.min_requests else baseline
    ref_ok = ref.count >= plan.min_requests
    ref_rate = ref.error_rate if ref_ok else 0.0
    # The error rate at min_requests if every further request succeeded (the error rate itself
    # once there are min_requests): with a reference to compare with, a breach is called as
    # soon as it is certain.
    early = ref_ok or new.count >= plan.min_requests
    at_min = new.errors / max(new.count, plan.min_requests)
    if early and at_min - ref_rate > plan.max_error_rate_increase:
        return Judgement(
            Event.BREACHED,
            f"error rate of the new policy {_pct(new.error_rate)} vs {_pct(ref_rate)} of the "
            f"old (allowed increase {_pct(plan.max_error_rate_increase)}; "
            f"{new.errors}/{new.count} requests failed)",
        )
    if new.count < plan.min_requests:
        return Judgement(None, f"waiting for traffic ({new.count}/{plan.min_requests})")
    new_p95, ref_p95 = new.p95(), ref.p95()
    if ref_ok and new_p95 is not None and ref_p95 is not None:
        allowed = ref_p95 * plan.max_p95_ratio + plan.p95_slack_s
        if new_p95 > allowed:
            return Judgement(
                Event.BREACHED,
                f"p95 of the new policy {new_p95:.3f}s vs {ref_p95:.3f}s of the old "
                f"(allowed {allowed:.3f}s)",
            )
    if elapsed >= plan.hold_s:
        return Judgement(Event.PASSED, "error rate and p95 within bounds")
    return Judgement(None, "holding")


# gRPC codes that count as a failure of the serving side: UNKNOWN, DEADLINE_EXCEEDED,
# UNIMPLEMENTED (no route), INTERNAL, UNAVAILABLE. Client-caused codes (CANCELLED,
# INVALID_ARGUMENT, UNAUTHENTICATED, RESOURCE_EXHAUSTED ...) do not.
FAILED_GRPC: Final = frozenset({2, 4, 12, 13, 14})


def is_failure(grpc: bool, http_status: int, grpc_status: int | None, refused: bool) -> bool:
    """A request that counts against a policy in a rollout: a 5xx (upstream failure, timeout,
    no endpoint), one of `FAILED_GRPC` (a gRPC call that ended without a status counts as
    UNKNOWN, as in the metrics), or Sluice's own 404 (no route) / 413 (body limit). `refused`:
    Sluice answered it without the backend."""
    if grpc:
        return (grpc_status if grpc_status is not None else 2) in FAILED_GRPC
    if http_status >= 500:
        return True
    return refused and http_status in (404, 413)
