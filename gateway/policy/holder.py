"""PolicyHolder: the one owner of the serving policy; guards, stages and swaps each change.

A request takes its snapshot once at arrival (`Gateway.snapshot_for`: `holder.active`, or during
a staged rollout the side `holder.rollout.choose` picks) and keeps it to its end, so requests in
flight finish on the policy they started with.

A reload: load → compile → change guard → build → apply at once, or start a staged rollout (the
new policy's `rollout:` section, or the one the caller passes). A failed reload leaves
everything untouched. A change the guard holds (see `guard.py`) is not applied unless forced
(`force=True`, or `force: true` in the file); a version that a rollout rolled back is held the
same way until forced, so an automated re-push cannot bounce the gateway. During a rollout the
holder keeps both snapshots; a new reload supersedes it (the rollout is aborted, the new change
is judged against the stable policy), and a reload of the stable version ends it.

`on_swap` subscribers run after the serving set changes: a swap, a completed rollout, and a
rolled-back or aborted one (the candidate's upstreams can go). `on_candidate` subscribers run
when a rollout's candidate goes live.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Generic, TypeVar

from gateway.core import rollout as core
from gateway.errors import PolicyError
from gateway.policy.compiled import CompiledPolicy, compile_policy
from gateway.policy.guard import GuardReport, check_change, summarize
from gateway.policy.loader import load_policy, load_policy_text
from gateway.policy.model import Rollout
from gateway.policy.rollout import RolloutController, ShadowHook
from gateway.policy.traffic import TrafficSnapshot
from gateway.services import ServiceKey
from gateway.telemetry import metrics

log = logging.getLogger("sluice.policy")

A = TypeVar("A")  # what the gateway builds from a compiled policy (policy + chain)
MAX_EVENTS = 50
MAX_REMEMBERED_ROLLBACKS = 16


class _FromPolicy:
    """The `rollout` argument's default: whatever the new policy's `rollout:` section says."""


FROM_POLICY = _FromPolicy()


@dataclass(frozen=True, slots=True)
class ReloadResult:
    ok: bool
    changed: bool
    version: str  # the version serving after this attempt (the old one if it failed)
    errors: tuple[str, ...] = ()  # one `PATH:LINE:COL: message` per problem
    held: bool = False  # the guard (or an earlier rollback) kept the change out
    rollout: bool = False  # a staged rollout of the change started
    guard: GuardReport | None = None


class PolicyHolder(Generic[A]):
    """Owns the serving policy. `reload()` is synchronous and never raises: call it from the
    event loop (SIGHUP, POST /admin/policy/reload, the file watcher); it runs to completion
    without awaiting, so two reloads never interleave. `tick()` drives a rollout's stages."""

    def __init__(
        self,
        path: Path,
        build: Callable[[CompiledPolicy], A],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._build = build
        self.clock = clock
        compiled = compile_policy(load_policy(path))  # raises PolicyError: fatal at boot
        self._active: A = build(compiled)
        self._compiled = compiled
        self.version = compiled.version
        self.reloads = 0  # reload attempts since boot, whatever their result
        self.last_result = ReloadResult(True, True, compiled.version)
        self.last_reload_at = time.time()
        self.loaded_at = self.last_reload_at  # when the serving version was swapped in
        self.last_errors: tuple[str, ...] = ()  # errors of the latest failed attempt
        self.last_error_at: float | None = None
        self._subscribers: list[Callable[[], None]] = []
        self._candidate_subscribers: list[Callable[[A], None]] = []
        # Set by the gateway: the recent traffic, and each snapshot's shadow hooks.
        self.traffic: Callable[[], TrafficSnapshot] | None = None
        self.shadow_hooks: Callable[[A], Sequence[ShadowHook]] = lambda _: ()
        self.rollout: RolloutController[A] | None = None
        self.last_rollout: dict[str, Any] | None = None
        self.last_guard: GuardReport | None = None
        self.held: dict[str, Any] | None = None
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self._rolled_back: dict[str, str] = {}  # version -> why its rollout was rolled back
        self.rollback_unresolved = False  # rolled back, and the file still holds that change
        metrics.POLICY_INFO.labels(compiled.version).set(1)
        metrics.POLICY_LAST_RELOAD_OK.set(1)
        metrics.POLICY_HELD.set(0)

    @property
    def active(self) -> A:
        """The stable snapshot (during a rollout: the old policy)."""
        return self._active

    @property
    def compiled(self) -> CompiledPolicy:
        """The compiled policy behind `active` (for /admin/policy and diffs)."""
        return self._compiled

    def on_swap(self, callback: Callable[[], None]) -> None:
        """Call `callback` after every change of the serving set, whoever caused it."""
        self._subscribers.append(callback)

    def on_candidate(self, callback: Callable[[A], None]) -> None:
        """Call `callback(snapshot)` when a rollout's candidate starts taking requests."""
        self._candidate_subscribers.append(callback)

    def _event(self, kind: str, message: str, **extra: Any) -> None:
        self.events.append({"at": time.time(), "event": kind, "message": message, **extra})

    # --- reload --------------------------------------------------------------------------------
    def reload(
        self,
        text: str | None = None,
        *,
        force: bool = False,
        rollout: Rollout | None | _FromPolicy = FROM_POLICY,
        rollout_fields: Mapping[str, Any] | None = None,
    ) -> ReloadResult:
        """Validate → compile → guard → build → swap or start a rollout. Any error keeps the old
        policy serving. `text`: the file's content as the caller read it (the watcher reads it
        twice and hands over what it verified); None reads the file. `rollout`: the policy's
        own `rollout:` section (default), None for all at once, or a plan; `rollout_fields`
        override fields of the policy's section (or of the defaults) and imply a rollout."""
        self.reloads += 1
        self.last_reload_at = time.time()
        try:
            name = str(self.path)
            policy = load_policy(self.path) if text is None else load_policy_text(text, name)
            compiled = compile_policy(policy)
            if rollout_fields:
                base = policy.rollout.model_dump() if policy.rollout is not None else {}
                try:
                    rollout = Rollout.model_validate({**base, **rollout_fields})
                except ValueError as e:
                    raise PolicyError([f"{self.path}:1:1: rollout: {e}"]) from None
            result = self._consider(compiled, force or policy.force, rollout)
        except PolicyError as e:
            result = self._failed(tuple(e.errors))
        except Exception as e:  # a bug in compile/build must not take the serving policy down
            log.exception("policy build failed")
            result = self._failed(
                (f"{self.path}:1:1: cannot build policy: {type(e).__name__}: {e}",)
            )
        metrics.POLICY_LAST_RELOAD_OK.set(1 if result.ok and not result.held else 0)
        self.last_result = result
        if result.changed:
            self._notify()
        return result

    def _consider(
        self, compiled: CompiledPolicy, forced: bool, rollout: Rollout | None | _FromPolicy
    ) -> ReloadResult:
        ro = self.rollout
        if compiled.version == self.version:
            if ro is not None:
                self._end_rollout(core.Event.ABORT, "the file is back to the serving version")
            self._clear_held()
            self.rollback_unresolved = False
            metrics.POLICY_RELOADS.labels("unchanged").inc()
            return ReloadResult(True, False, self.version)
        if ro is not None and compiled.version == ro.to_version:
            metrics.POLICY_RELOADS.labels("unchanged").inc()
            return ReloadResult(True, False, self.version, rollout=True)
        report = self._guard(compiled)
        if not forced:
            why = self._rolled_back.get(compiled.version)
            if why is not None:
                return self._hold(compiled, report, f"its rollout was rolled back ({why})")
            if report is not None and report.held:
                return self._hold(compiled, report, "")
        elif report is not None and report.held:
            log.warning(
                "policy change %s -> %s forced past the guard (%.1f%% of recent traffic "
                "would be refused: %s)",
                self.version,
                compiled.version,
                100 * report.share,
                summarize(report.findings),
            )
        spec = compiled.policy.rollout if isinstance(rollout, _FromPolicy) else rollout
        built = self._build(compiled)
        if ro is not None:
            self._end_rollout(core.Event.ABORT, f"superseded by version {compiled.version}")
        self._clear_held()
        self.rollback_unresolved = False
        if spec is None:
            self._swap(built, compiled)
            metrics.POLICY_RELOADS.labels("ok").inc()
            self._event("applied", f"{compiled.version} serving", version=compiled.version)
            return ReloadResult(True, True, compiled.version, guard=report)
        self._start_rollout(spec, built, compiled)
        metrics.POLICY_RELOADS.labels("rollout").inc()
        return ReloadResult(True, False, self.version, rollout=True, guard=report)

    def _guard(self, compiled: CompiledPolicy) -> GuardReport | None:
        if self.traffic is None or not compiled.policy.guard.enabled:
            return None
        report = check_change(self._compiled, compiled, self.traffic(), compiled.policy.guard)
        self.last_guard = report
        metrics.POLICY_GUARD_SHARE.set(report.share)
        return report

    def _hold(self, compiled: CompiledPolicy, report: GuardReport | None, why: str) -> ReloadResult:
        reason = why or (
            f"{100 * (report.share if report else 0):.1f}% of the recent traffic would be "
            f"refused: {summarize(report.findings) if report else ''}"
        )
        self.held = {
            "version": compiled.version,
            "at": time.time(),
            "reason": reason,
            "guard": report.as_json() if report is not None else None,
            "lines": report.lines() if report is not None and report.held else [],
        }
        metrics.POLICY_RELOADS.labels("held").inc()
        metrics.POLICY_HELD.set(1)
        log.warning(
            "policy change %s -> %s HELD, %s keeps serving: %s; apply it anyway with "
            "`sluice policy apply --force` or POST /admin/policy/reload?force=1",
            self.version,
            compiled.version,
            self.version,
            reason,
        )
        self._event("held", reason, version=compiled.version)
        return ReloadResult(True, False, self.version, held=True, guard=report)

    def _clear_held(self) -> None:
        self.held = None
        metrics.POLICY_HELD.set(0)

    def _swap(self, active: A, compiled: CompiledPolicy) -> None:
        # Only plain assignments from here on: nothing can fail halfway through the swap.
        self._active, self._compiled = active, compiled
        metrics.POLICY_INFO.remove(self.version)
        metrics.POLICY_INFO.labels(compiled.version).set(1)
        log.info("policy reloaded: %s -> %s", self.version, compiled.version)
        self.version = compiled.version
        self.loaded_at = time.time()

    def _notify(self) -> None:
        for callback in self._subscribers:
            try:
                callback()
            except Exception:  # a subscriber's bug must not undo a good reload
                log.exception("policy swap subscriber failed")

    def _failed(self, errors: tuple[str, ...]) -> ReloadResult:
        self.last_errors = errors
        self.last_error_at = self.last_reload_at
        metrics.POLICY_RELOADS.labels("error").inc()
        log.error("policy reload rejected, %s keeps serving:\n%s", self.version, "\n".join(errors))
        self._event("rejected", errors[0] if errors else "rejected")
        return ReloadResult(False, False, self.version, errors)

    # --- rollout -------------------------------------------------------------------------------
    def _start_rollout(self, spec: Rollout, built: A, compiled: CompiledPolicy) -> None:
        hooks = (self.shadow_hooks(self._active), self.shadow_hooks(built))
        ro = RolloutController(
            spec, self._active, built, self._compiled, compiled, self.clock(), hooks
        )
        self.rollout = ro
        stages = ", ".join(ro.status(self.clock())["stages"])
        log.info(
            "policy rollout %s -> %s started: stages %s, hold %gs",
            ro.from_version,
            ro.to_version,
            stages,
            spec.hold_s,
        )
        self._event("rollout_started", f"stages {stages}", version=ro.to_version)
        for callback in self._candidate_subscribers:
            try:
                callback(built)
            except Exception:
                log.exception("policy candidate subscriber failed")

    def tick(self, now: float | None = None) -> None:
        """Judge the running rollout's stage (the server calls it ~10 times a second)."""
        ro = self.rollout
        if ro is None:
            return
        now = self.clock() if now is None else now
        before = ro.stage
        state = ro.tick(now)
        if state is not None:
            self._after_step(ro, before, state, now)

    def promote(self) -> dict[str, Any] | None:
        """Move the rollout to its next stage now (the last one completes it)."""
        ro = self.rollout
        if ro is None:
            return None
        now = self.clock()
        before = ro.stage
        state = ro.apply(core.Event.PROMOTE, now, "promoted by hand")
        if state is not None:
            self._after_step(ro, before, state, now)
        return ro.status(now)

    def abort(self, reason: str = "aborted by hand") -> dict[str, Any] | None:
        if self.rollout is None:
            return None
        ro = self.rollout
        self._end_rollout(core.Event.ABORT, reason)
        self._notify()
        return ro.status(self.clock())

    def _end_rollout(self, event: core.Event, reason: str) -> None:
        ro = self.rollout
        if ro is None:
            return
        now = self.clock()
        before = ro.stage
        state = ro.apply(event, now, reason)
        if state is not None:
            self._after_step(ro, before, state, now, notify=False)

    def _after_step(
        self,
        ro: RolloutController[A],
        before: str,
        state: core.State,
        now: float,
        notify: bool = True,
    ) -> None:
        versions = f"{ro.from_version} -> {ro.to_version}"
        if not state.terminal:
            log.info(
                "policy rollout %s: stage %s passed (%s); now %s",
                versions,
                before,
                state.reason,
                ro.stage,
            )
            self._event("stage", f"{before} -> {ro.stage}: {state.reason}", version=ro.to_version)
            return
        self.rollout = None
        self.last_rollout = ro.status(now)
        stopped = self.last_rollout["stopped"]
        if state.phase is core.Phase.COMPLETE:
            self._swap(ro.candidate, ro.candidate_policy)
            metrics.POLICY_ROLLOUTS.labels("completed").inc()
            self._event("rollout_completed", f"{ro.to_version} serving", version=ro.to_version)
        elif state.phase is core.Phase.ROLLED_BACK:
            if len(self._rolled_back) >= MAX_REMEMBERED_ROLLBACKS:
                self._rolled_back.pop(next(iter(self._rolled_back)))
            self._rolled_back[ro.to_version] = state.reason
            self.rollback_unresolved = True
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
            self._event("rolled_back", f"at {before}: {state.reason}", version=ro.to_version)
        else:
            metrics.POLICY_ROLLOUTS.labels("aborted").inc()
            log.warning("policy rollout %s aborted at stage %s: %s", versions, before, state.reason)
            self._event("rollout_aborted", f"at {before}: {state.reason}", version=ro.to_version)
        if notify:
            self._notify()

    # --- reporting -------------------------------------------------------------------------------
    def rollout_status(self) -> dict[str, Any] | None:
        ro = self.rollout
        if ro is not None:
            return ro.status(self.clock())
        return self.last_rollout

    def status(self) -> dict[str, object]:
        r = self.last_result
        return {
            "path": str(self.path),
            "version": self.version,
            "loaded_at": self.loaded_at,
            "reloads": self.reloads,
            "last_reload": {
                "ok": r.ok,
                "changed": r.changed,
                "held": r.held,
                "rollout": r.rollout,
                "errors": list(r.errors),
                "at": self.last_reload_at,
            },
            "last_error": {"errors": list(self.last_errors), "at": self.last_error_at},
            "held": self.held,
            "guard": self.last_guard.as_json() if self.last_guard is not None else None,
            "rollout": self.rollout_status(),
            "events": list(self.events),
        }


class RolloutView:
    """The `rollout` section of `/admin/state` (a services owner over the holder): the stage of
    a running rollout and its comparison, a held change, how the last rollout ended. Yellow
    while a change is held or after a rollback (the file on disk is not what serves)."""

    def __init__(self, holder: PolicyHolder[Any]) -> None:
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
