"""RolloutController: one staged rollout of a policy change, while the holder keeps both
snapshots. It picks the snapshot of each arriving request, counts how each side does, and turns
the pure stage machine of `gateway.core.rollout` into the holder's actions.

Which side serves a request: a hash (CRC-32) of its incoming `x-request-id` when the client
sent a well-formed one, so a client that retries with the same id lands on the same side, and
a request once on the new policy stays there as the stages grow; otherwise a per-process counter
stepped by a prime, which spreads requests evenly across the share. The choice is made once, at
arrival (`Gateway.snapshot_for`), and the request keeps that snapshot to its end, whatever the
rollout does meanwhile.

Stages are judged ~10 times a second by the server's ticker, and at once (at most every
`URGENT_S`) when a request on the new policy fails, so a breach is called on the failure that
makes it certain.

Shadow stage: for every request (served by the old policy) both policies' decisions are
computed without effect: the route that matches, whether it has a usable endpoint, the body
limit against the declared Content-Length; plus, for any filter of either chain that defines a
`shadow_request(ctx) -> Status` hook (decide without taking a token or filling a cache), that
hook on a scratch context. No filter of the built-in set defines one yet, so auth and limit
decisions are not shadowed until their filters add it.
"""

from __future__ import annotations

import re
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from gateway.context import RequestContext, Status
from gateway.core import rollout as core
from gateway.core.outcome import Outcome
from gateway.core.request import RequestInfo, Wire
from gateway.policy.compiled import CompiledPolicy
from gateway.policy.model import Rollout
from gateway.reload.guard import usable_routes
from gateway.telemetry import metrics

A = TypeVar("A")
ShadowHook = Callable[[RequestContext], Status]

_VALID_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$").match  # as the request_id filter's
_SPREAD = 7919  # prime, coprime with 10 000: the counter visits every basis point in turn
URGENT_S = 0.01  # a failure on the new side is judged at once, at most this often


def plan_of(spec: Rollout) -> core.Plan:
    stages = tuple(core.SHADOW if s == "shadow" else float(s) for s in spec.stages)
    return core.Plan(
        stages,
        spec.hold_s,
        spec.min_requests,
        spec.max_error_rate_increase,
        spec.max_p95_ratio,
        spec.p95_slack_s,
    )


def stage_name(stage: float) -> str:
    return "shadow" if stage == core.SHADOW else f"{stage:g}%"


class _Side:
    """One policy's compile-level decisions for the shadow stage."""

    def __init__(self, policy: CompiledPolicy, hooks: Sequence[ShadowHook]) -> None:
        self.policy = policy
        self.usable = usable_routes(policy.policy)
        self.max_body = policy.policy.limits.max_body_bytes
        self.hooks = tuple(hooks)

    def decide(self, info: RequestInfo) -> tuple[str, bool]:
        route = self.policy.match(info)
        if route is None:
            return "no_route", True
        if route.name not in self.usable:
            return f"no_endpoint:{route.name}", True
        cl = info.content_length
        if info.protocol is Wire.HTTP and cl is not None and cl > self.max_body:
            return "body_too_large", True
        if self.hooks:
            ctx = RequestContext(info, self.policy)
            ctx.route = route
            for hook in self.hooks:
                if hook(ctx) is Status.STOP:
                    return f"{ctx.verdict.error_type or 'rejected'}", True
        return f"route:{route.name}", False


class RolloutController(Generic[A]):
    def __init__(
        self,
        spec: Rollout,
        stable: A,
        candidate: A,
        stable_policy: CompiledPolicy,
        candidate_policy: CompiledPolicy,
        now: float,
        hooks: tuple[Sequence[ShadowHook], Sequence[ShadowHook]] = ((), ()),
    ) -> None:
        self.spec = spec
        self.plan = plan_of(spec)
        self.stable = stable
        self.candidate = candidate
        self.candidate_policy = candidate_policy
        self.from_version = stable_policy.version
        self.to_version = candidate_policy.version
        self._old_side = _Side(stable_policy, hooks[0])
        self._new_side = _Side(candidate_policy, hooks[1])
        self.state = core.start(self.plan, now)
        self.started = now
        self.started_wall = time.time()
        self.first_serving_at: float | None = None  # when a stage first sent requests to new
        self.ended_at: float | None = None
        self.old = core.ShareStats()
        self.new = core.ShareStats()
        self.baseline = core.ShareStats()  # the old side over every stage so far
        self.shadow = core.ShadowStats()
        self.chosen_new = 0  # requests handed the new snapshot, over the whole rollout
        self.chosen_old = 0
        self.waiting = ""  # why the current stage has not advanced yet
        self.history: list[dict[str, Any]] = []
        self._n = 0
        self._reported = (0, 0)
        self.urgent = False  # a failure of the new side waits to be judged
        self._judged = 0.0  # time.monotonic() of the last judgement
        self._apply_share(now)

    # --- per request -------------------------------------------------------------------------
    def choose(self, info: RequestInfo) -> A:
        bp = self.share_bp
        if bp <= 0:
            if self.shadowing:
                self._shadow(info)
            self.chosen_old += 1
            return self.stable
        if bp >= 10_000:
            self.chosen_new += 1
            return self.candidate
        rid = info.headers.get("x-request-id")
        if rid is not None and _VALID_ID(rid):
            h = zlib.crc32(rid.encode()) % 10_000
        else:
            self._n += 1
            h = (self._n * _SPREAD) % 10_000
        if h < bp:
            self.chosen_new += 1
            return self.candidate
        self.chosen_old += 1
        return self.stable

    def record(self, snapshot: A, ctx: RequestContext) -> None:
        """A request of this rollout finished; count it on its side (ignored once over)."""
        if self.ended_at is not None:
            return
        if snapshot is self.candidate:
            side = self.new
        elif snapshot is self.stable:
            side = self.old
        else:
            return  # started before this rollout
        grpc = ctx.info.protocol is Wire.GRPC
        refused = ctx.outcome is Outcome.REJECTED
        failed = core.is_failure(grpc, ctx.http_status, ctx.grpc_status, refused)
        side.add(ctx.elapsed, failed)
        if failed and side is self.new and time.monotonic() - self._judged >= URGENT_S:
            self.urgent = True  # judge now, not at the next tick: a breach may be certain

    def _shadow(self, info: RequestInfo) -> None:
        old, old_reject = self._old_side.decide(info)
        new, new_reject = self._new_side.decide(info)
        self.shadow.add(old, new, old_reject, new_reject)

    # --- stages --------------------------------------------------------------------------------
    def _apply_share(self, now: float) -> None:
        share = core.share_of(self.plan, self.state)
        self.share_bp = int(round(share * 100))
        self.shadowing = self.state.phase is core.Phase.SHADOW
        if self.share_bp > 0 and self.first_serving_at is None:
            self.first_serving_at = now
        metrics.POLICY_ROLLOUT_STAGE.set(share if not self.state.terminal else -1)

    @property
    def stage(self) -> str:
        if self.state.phase is core.Phase.COMPLETE:
            return "100%"
        return stage_name(self.plan.stages[min(self.state.index, len(self.plan.stages) - 1)])

    def tick(self, now: float) -> core.State | None:
        """Judge the current stage; returns the new state when it changed."""
        if self.state.terminal:
            return None
        self.urgent = False
        self._judged = time.monotonic()
        self._report_metrics()
        elapsed = now - self.state.stage_started
        if self.state.phase is core.Phase.SHADOW:
            j = core.judge_shadow(self.plan, self.shadow, elapsed)
        else:
            j = core.judge_serving(self.plan, self.old, self.new, self.baseline, elapsed)
        if j.event is None:
            self.waiting = j.reason
            return None
        return self.apply(j.event, now, j.reason)

    def apply(self, event: core.Event, now: float, reason: str = "") -> core.State | None:
        prev = self.state
        nxt = core.step(self.plan, prev, event, now, reason)
        if nxt is prev:
            return None
        self._report_metrics()
        self.history.append(
            {
                "stage": self.stage,
                "event": event.value,
                "reason": reason,
                "seconds": round(now - prev.stage_started, 3),
                **self._comparison(),
            }
        )
        self.state = nxt
        self.baseline.absorb(self.old)
        self.old, self.new, self.shadow = core.ShareStats(), core.ShareStats(), core.ShadowStats()
        self.waiting = ""
        if nxt.terminal:
            self.ended_at = now
        self._apply_share(now)
        return nxt

    def _comparison(self) -> dict[str, Any]:
        if self.state.phase is core.Phase.SHADOW:
            return {"shadow": self.shadow.summary()}
        return {
            "old": self.old.summary(),
            "new": self.new.summary(),
            "baseline": self.baseline.summary(),
        }

    def _report_metrics(self) -> None:
        new, old = self.chosen_new, self.chosen_old
        dn, do = new - self._reported[0], old - self._reported[1]
        if dn:
            metrics.POLICY_ROLLOUT_REQUESTS.labels("new").inc(dn)
        if do:
            metrics.POLICY_ROLLOUT_REQUESTS.labels("old").inc(do)
        self._reported = (new, old)
        for label, side in (("old", self.old), ("new", self.new)):
            metrics.POLICY_ROLLOUT_ERROR_RATE.labels(label).set(side.error_rate)
            p95 = side.p95()
            metrics.POLICY_ROLLOUT_P95.labels(label).set(p95 if p95 is not None else 0.0)

    # --- reporting -------------------------------------------------------------------------------
    def status(self, now: float) -> dict[str, Any]:
        st = self.state
        out: dict[str, Any] = {
            "from_version": self.from_version,
            "to_version": self.to_version,
            "phase": st.phase.value,
            "stage": self.stage,
            "stage_index": st.index,
            "stages": [stage_name(s) for s in self.plan.stages],
            "share_percent": core.share_of(self.plan, st),
            "hold_s": self.plan.hold_s,
            "min_requests": self.plan.min_requests,
            "max_error_rate_increase": self.plan.max_error_rate_increase,
            "max_p95_ratio": self.plan.max_p95_ratio,
            "p95_slack_s": self.plan.p95_slack_s,
            "started_at": self.started_wall,
            "stage_elapsed_s": round((self.ended_at or now) - st.stage_started, 3),
            "requests": {"new": self.chosen_new, "old": self.chosen_old},
            "waiting": self.waiting,
            "history": self.history,
        }
        if not st.terminal:
            out["comparison"] = self._comparison()
        else:
            out["stopped"] = {
                "reason": st.reason,
                "new_requests_served": self.chosen_new,
                "seconds": round((self.ended_at or now) - self.started, 3),
                "seconds_since_first_serving_stage": None
                if self.first_serving_at is None
                else round((self.ended_at or now) - self.first_serving_at, 3),
            }
        return out
