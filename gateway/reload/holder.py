"""PolicyHolder: the one owner of the serving policy; guards and swaps each change (staged
rollouts are orchestrated in `staging.py`, each one's split and comparison in `rollout.py`).

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

The swap activates: a subscriber that raises (an owner that cannot take the new policy) fails
the change. The previous policy is swapped back and the subscribers run again for it, so nothing
half-activated serves; the reload reports `ok: false` with the error (`/admin/policy`,
`sluice_policy_reloads_total{result="error"}`, the log).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from gateway.core import rollout as core
from gateway.errors import PolicyError
from gateway.policy.compiled import CompiledPolicy, compile_policy
from gateway.policy.loader import checked_policy, checked_policy_text
from gateway.policy.model import Policy, Rollout
from gateway.reload.guard import GuardReport, check_change, summarize
from gateway.reload.rollout import RolloutController, ShadowHook
from gateway.reload.staging import StagedRollouts
from gateway.reload.traffic import TrafficSnapshot
from gateway.telemetry import metrics

log = logging.getLogger("sluice.policy")

A = TypeVar("A")  # what the gateway builds from a compiled policy (policy + chain)
MAX_EVENTS = 50


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
        compiled = compile_policy(self._load(None))  # raises PolicyError: fatal at boot
        # The stable snapshot (during a rollout: the old policy). A plain attribute, read by
        # every request (a property is a Python-level call); only `_swap` assigns it.
        self.active: A = build(compiled)
        self._compiled = compiled
        self.version = compiled.version
        self.reloads = 0  # reload attempts since boot, whatever their result
        self.last_result = ReloadResult(True, True, compiled.version)
        self.last_reload_at = time.time()
        self.loaded_at = self.last_reload_at  # when the serving version was swapped in
        self.last_errors: tuple[str, ...] = ()  # errors of the latest failed attempt
        self.last_error_at: float | None = None
        self._subscribers: list[Callable[[], None]] = []
        # Set by the gateway: the recent traffic, and each snapshot's shadow hooks.
        self.traffic: Callable[[], TrafficSnapshot] | None = None
        self.shadow_hooks: Callable[[A], Sequence[ShadowHook]] = lambda _: ()
        self.rollout: RolloutController[A] | None = None  # read per request: a plain attribute
        self.staged = StagedRollouts(self)
        self.last_guard: GuardReport | None = None
        self.held: dict[str, Any] | None = None
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        metrics.POLICY_INFO.labels(compiled.version).set(1)
        metrics.POLICY_LAST_RELOAD_OK.set(1)
        metrics.POLICY_HELD.set(0)

    @property
    def compiled(self) -> CompiledPolicy:
        """The compiled policy behind `active` (for /admin/policy and diffs)."""
        return self._compiled

    def on_swap(self, callback: Callable[[], None]) -> None:
        """Call `callback` after every change of the serving set, whoever caused it."""
        self._subscribers.append(callback)

    def on_candidate(self, callback: Callable[[A], None]) -> None:
        """Call `callback(snapshot)` when a rollout's candidate starts taking requests."""
        self.staged.on_candidate(callback)

    def event(self, kind: str, message: str, **extra: Any) -> None:
        """One line of the holder's recent history (`/admin/policy` events)."""
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
            policy = self._load(text)
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
        return result

    def _load(self, text: str | None) -> Policy:
        """The policy in `text` (None: read the file), its warnings logged once per load: valid
        but unsafe settings, such as a backend's `insecure_skip_verify`, the same lines `sluice
        policy check` prints (field and backend name only, never file contents)."""
        if text is None:
            policy, warnings = checked_policy(self.path)
        else:
            policy, warnings = checked_policy_text(text, str(self.path))
        for line in warnings:
            log.warning("%s", line)
        return policy

    def _consider(
        self, compiled: CompiledPolicy, forced: bool, rollout: Rollout | None | _FromPolicy
    ) -> ReloadResult:
        ro = self.rollout
        if compiled.version == self.version:
            if ro is not None:
                self.staged.end(core.Event.ABORT, "the file is back to the serving version")
            self._clear_held()
            self.staged.unresolved = False
            metrics.POLICY_RELOADS.labels("unchanged").inc()
            return ReloadResult(True, False, self.version)
        if ro is not None and compiled.version == ro.to_version:
            metrics.POLICY_RELOADS.labels("unchanged").inc()
            return ReloadResult(True, False, self.version, rollout=True)
        report = self._guard(compiled)
        if not forced:
            why = self.staged.rolled_back.get(compiled.version)
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
            self.staged.end(core.Event.ABORT, f"superseded by version {compiled.version}")
        self._clear_held()
        self.staged.unresolved = False
        if spec is None:
            error = self.commit(built, compiled)
            if error is not None:
                raise PolicyError([f"{self.path}:1:1: {error}"])
            metrics.POLICY_RELOADS.labels("ok").inc()
            self.event("applied", f"{compiled.version} serving", version=compiled.version)
            return ReloadResult(True, True, compiled.version, guard=report)
        error = self.staged.start(spec, built, compiled)
        if error is not None:
            raise PolicyError([f"{self.path}:1:1: {error}"])
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
        self.event("held", reason, version=compiled.version)
        return ReloadResult(True, False, self.version, held=True, guard=report)

    def _clear_held(self) -> None:
        self.held = None
        metrics.POLICY_HELD.set(0)

    def commit(self, active: A, compiled: CompiledPolicy) -> str | None:
        """Swap `active` in and activate it (the `on_swap` subscribers). If one fails, swap the
        previous policy back, activate it again, and return the error."""
        before = (self.active, self._compiled, self.loaded_at)
        self._swap(active, compiled)
        error = self.notify()
        if error is None:
            log.info("policy reloaded: %s -> %s", before[1].version, compiled.version)
            return None
        log.error(
            "policy %s could not be activated, %s keeps serving: %s",
            compiled.version,
            before[1].version,
            error,
        )
        self._swap(before[0], before[1])
        self.loaded_at = before[2]
        again = self.notify()
        if again is not None:
            log.error("policy %s: activating it again failed too: %s", self.version, again)
        return f"cannot activate policy {compiled.version}: {error}"

    def _swap(self, active: A, compiled: CompiledPolicy) -> None:
        # Only plain assignments here: nothing can fail halfway through the swap itself.
        self.active, self._compiled = active, compiled
        metrics.POLICY_INFO.remove(self.version)
        metrics.POLICY_INFO.labels(compiled.version).set(1)
        self.version = compiled.version
        self.loaded_at = time.time()

    def notify(self) -> str | None:
        """Run the `on_swap` subscribers for the serving set; stop at the first that fails and
        return its error (logged with its traceback)."""
        for callback in self._subscribers:
            try:
                callback()
            except Exception as e:
                log.exception("policy swap subscriber %s failed", _name(callback))
                return f"{_name(callback)}: {type(e).__name__}: {e}"
        return None

    def _failed(self, errors: tuple[str, ...]) -> ReloadResult:
        self.last_errors = errors
        self.last_error_at = self.last_reload_at
        metrics.POLICY_RELOADS.labels("error").inc()
        log.error("policy reload rejected, %s keeps serving:\n%s", self.version, "\n".join(errors))
        self.event("rejected", errors[0] if errors else "rejected")
        return ReloadResult(False, False, self.version, errors)

    # --- rollout (orchestrated in staging.py) --------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        """Judge the running rollout's stage (the server calls it ~10 times a second)."""
        if self.rollout is not None:
            self.staged.tick(now)

    def promote(self) -> dict[str, Any] | None:
        """Move the rollout to its next stage now (the last one completes it)."""
        return self.staged.promote()

    def abort(self, reason: str = "aborted by hand") -> dict[str, Any] | None:
        return self.staged.abort(reason)

    @property
    def last_rollout(self) -> dict[str, Any] | None:
        return self.staged.last

    @property
    def rollback_unresolved(self) -> bool:
        return self.staged.unresolved

    # --- reporting -------------------------------------------------------------------------------
    def rollout_status(self) -> dict[str, Any] | None:
        return self.staged.status()

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


def _name(callback: Callable[..., object]) -> str:
    return getattr(callback, "__qualname__", None) or type(callback).__name__
