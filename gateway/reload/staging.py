"""Staged rollouts, orchestrated: start a candidate beside the stable policy, judge its stages,
and end it (completed, rolled back, aborted) through the holder's swap.

The holder (`holder.py`) owns the serving policy and the swap; a `RolloutController`
(`rollout.py`) is one rollout's comparison and request split. This module sits between them: it
turns the controller's stage decisions into the holder's actions, and remembers the versions
whose rollout was rolled back (held until forced, so an automated re-push cannot bounce the
gateway). A candidate whose activation fails never starts; a completion whose activation fails
is rolled back (the stable policy is activated again).

`RolloutView` is the `rollout` section of /admin/state (services key `ROLLOUT`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Final, Generic, Protocol, TypeVar

from gateway.core import rollout as core
from gateway.policy.compiled import CompiledPolicy
from gateway.policy.model import Rollout
from gateway.reload.rollout import RolloutController, ShadowHook
from gateway.services import ServiceKey
from gateway.telemetry import metrics

log = logging.getLogger("sluice.policy")

A = TypeVar("A")
MAX_REMEMBERED_ROLLBACKS = 16


class Serving(Protocol[A]):
    """What the orchestration needs of the holder."""

    rollout: RolloutController[A] | None
    clock: Callable[[], float]
    shadow_hooks: Callable[[A], Sequence[ShadowHook]]

    @property
    def active(self) -> A: ...

    @property
    def compiled(self) -> CompiledPolicy: ...

    def commit(self, active: A, compiled: CompiledPolicy) -> str | None: ...

    def notify(self) -> str | None: ...

    def event(self, kind: str, message: str, **extra: Any) -> None: ...


class StagedRollouts(Generic[A]):
    """The rollout side of a holder: at most one rollout at a time (`holder.rollout`)."""

    def __init__(self, holder: Serving[A]) -> None:
        self._holder = holder
        self.last: dict[str, Any] | None = None  # how the last rollout ended
        self.rolled_back: dict[str, str] = {}  # version -> why its rollout was rolled back
        self.unresolved = False  # rolled back, and the file still holds that change
        self._candidate_subscribers: list[Callable[[A], None]] = []

    def on_candidate(self, callback: Callable[[A], None]) -> None:
        self._candidate_subscribers.append(callback)

    def start(self, spec: Rollout, built: A, compiled: CompiledPolicy) -> str | None:
        """Start serving `built` to a share of requests. Returns the error (and starts
        nothing) if a candidate subscriber fails: the stable policy is activated again."""
        h = self._holder
        hooks = (h.shadow_hooks(h.active), h.shadow_hooks(built))
        ro = RolloutController(spec, h.active, built, h.compiled, compiled, h.clock(), hooks)
        for callback in self._candidate_subscribers:
            try:
                callback(built)
            except Exception as e:
                log.exception(
                    "policy candidate %s: activation failed; %s keeps serving",
                    compiled.version,
                    h.compiled.version,
                )
                h.notify()  # owners follow the stable policy again
                return f"cannot activate candidate {compiled.version}: {type(e).__name__}: {e}"
        h.rollout = ro
        stages = ", ".join(ro.status(h.clock())["stages"])
        log.info(
            "policy rollout %s -> %s started: stages %s, hold %gs",
            ro.from_version,
            ro.to_version,
            stages,
            spec.hold_s,
        )
        h.event("rollout_started", f"stages {stages}", version=ro.to_version)
        return None

    def tick(self, now: float | None = None) -> None:
        ro = self._holder.rollout
        if ro is None:
            return
        now = self._holder.clock() if now is None else now
        before = ro.stage
        state = ro.tick(now)
        if state is not None:
            self._after_step(ro, before, state, now)

    def promote(self) -> dict[str, Any] | None:
        ro = self._holder.rollout
        if ro is None:
            return None
        now = self._holder.clock()
        before = ro.stage
        state = ro.apply(core.Event.PROMOTE, now, "promoted by hand")
        if state is not None:
            self._after_step(ro, before, state, now)
        return ro.status(now)

    def abort(self, reason: str) -> dict[str, Any] | None:
        ro = self._holder.rollout
        if ro is None:
            return None
        self.end(core.Event.ABORT, reason)
        self._holder.notify()
        return ro.status(self._holder.clock())

    def end(self, event: core.Event, reason: str) -> None:
        """End the running rollout without notifying (the caller swaps or notifies next)."""
        ro = self._holder.rollout
        if ro is None:
            return
        now = self._holder.clock()
        before = ro.stage
        state = ro.apply(event, now, reason)
        if state is not None:
            self._after_step(ro, before, state, now, notify=False)

    def status(self) -> dict[str, Any] | None:
        ro = self._holder.rollout
        if ro is not None:
            return ro.status(self._holder.clock())
        return self.last

    def _after_step(
        self,
        ro: RolloutController[A],
        before: str,
        state: core.State,
        now: float,
        notify: bool = True,
    ) -> None:
        h = self._holder
        versions = f"{ro.from_version} -> {ro.to_version}"
        if not state.terminal:
            log.info(
                "policy rollout %s: stage %s passed (%s); now %s",
                versions,
                before,
                state.reason,
                ro.stage,
            )
            h.event("stage", f"{before} -> {ro.stage}: {state.reason}", version=ro.to_version)
            return
        h.rollout = None
        self.last = ro.status(now)
        stopped = self.last["stopped"]
        if state.phase is core.Phase.COMPLETE:
            error = h.commit(ro.candidate, ro.candidate_policy)  # notifies, reverts on failure
            if error is None:
                metrics.POLICY_ROLLOUTS.labels("completed").inc()
                h.event("rollout_completed", f"{ro.to_version} serving", version=ro.to_version)
                return
            self.last["phase"] = core.Phase.ROLLED_BACK.value
            self.last["stopped"]["reason"] = error
            self._remember(ro.to_version, error)
            metrics.POLICY_ROLLOUTS.labels("rolled_back").inc()
            h.event("rolled_back", f"at completion: {error}", version=ro.to_version)
            return
        if state.phase is core.Phase.ROLLED_BACK:
            self._remember(ro.to_version, state.reason)
            metrics.POLICY_ROLLOUTS.labels("rolled_back").inc()
            log.warning(
                "policy rollout %s ROLLED BACK at stage %s: %s; the new policy served %d "
                "requests, %.2fs after its first serving stage began; %s keeps serving",
                versions,
                before,
                state.reason,
                ro.chosen_new,
                stopped["seconds_since_first_serving_stage"] or 0.0,
                ro.from_version,
            )
            h.event("rolled_back", f"at {before}: {state.reason}", version=ro.to_version)
        else:
            metrics.POLICY_ROLLOUTS.labels("aborted").inc()
            log.warning("policy rollout %s aborted at stage %s: %s", versions, before, state.reason)
            h.event("rollout_aborted", f"at {before}: {state.reason}", version=ro.to_version)
        if notify:
            h.notify()

    def _remember(self, version: str, why: str) -> None:
        if len(self.rolled_back) >= MAX_REMEMBERED_ROLLBACKS:
            self.rolled_back.pop(next(iter(self.rolled_back)))
        self.rolled_back[version] = why
        self.unresolved = True


class Shown(Protocol):
    """What the /admin/state section reads of the holder."""

    rollout: RolloutController[Any] | None
    clock: Callable[[], float]
    version: str
    held: dict[str, Any] | None

    @property
    def last_rollout(self) -> dict[str, Any] | None: ...

    @property
    def rollback_unresolved(self) -> bool: ...


class RolloutView:
    """The `rollout` section of `/admin/state` (a services owner over the holder): the stage of
    a running rollout and its comparison, a held change, how the last rollout ended. Yellow
    while a change is held or after a rollback (the file on disk is not what serves)."""

    def __init__(self, holder: Shown) -> None:
        self._holder = holder

    def state(self) -> dict[str, Any]:
        h = self._holder
        ro = h.rollout
        out: dict[str, Any] = {
            "colour": "green",
            "version": h.version,
            "stage": "",
            "candidate": "",
        }
        if ro is not None:
            st = ro.status(h.clock())
            out.update(
                stage=st["stage"],
                candidate=st["to_version"],
                share_percent=st["share_percent"],
                stage_elapsed_s=st["stage_elapsed_s"],
                waiting=st["waiting"],
                requests=st["requests"],
                **st.get("comparison", {}),
            )
        elif h.last_rollout is not None:
            last = h.last_rollout
            out["last"] = (
                f"{last['to_version']} {last['phase']} at {last['stage']}: "
                + (last["stopped"]["reason"])
            )
            if h.rollback_unresolved:
                out["colour"] = "yellow"
        if h.held is not None:
            out["colour"] = "yellow"
            out["held"] = f"{h.held['version']}: {h.held['reason']}"
        return out


ROLLOUT: Final = ServiceKey[RolloutView]("rollout")
