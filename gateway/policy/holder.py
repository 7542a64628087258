"""PolicyHolder: the one owner of the serving policy; swaps it atomically on reload.

A request reads `holder.active` once at arrival and keeps that snapshot to its end, so requests in
flight finish on the policy they started with. A failed reload leaves the snapshot untouched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from gateway.errors import PolicyError
from gateway.policy.compiled import CompiledPolicy, compile_policy
from gateway.policy.loader import load_policy
from gateway.telemetry import metrics

log = logging.getLogger("sluice.policy")

A = TypeVar("A")  # what the gateway builds from a compiled policy (policy + chain)


@dataclass(frozen=True, slots=True)
class ReloadResult:
    ok: bool
    changed: bool
    version: str  # the version serving after this attempt (the old one if it failed)
    errors: tuple[str, ...] = ()  # one `PATH:LINE:COL: message` per problem


class PolicyHolder(Generic[A]):
    """Owns the serving policy. `reload()` is synchronous and never raises: call it from the
    event loop (SIGHUP, POST /admin/policy/reload, the file watcher); it runs to completion
    without awaiting, so two reloads never interleave."""

    def __init__(self, path: Path, build: Callable[[CompiledPolicy], A]) -> None:
        self.path = path
        self._build = build
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
        metrics.POLICY_INFO.labels(compiled.version).set(1)
        metrics.POLICY_LAST_RELOAD_OK.set(1)

    @property
    def active(self) -> A:
        return self._active

    @property
    def compiled(self) -> CompiledPolicy:
        """The compiled policy behind `active` (for /admin/policy and diffs)."""
        return self._compiled

    def on_swap(self, callback: Callable[[], None]) -> None:
        """Call `callback` after every successful swap, whoever triggered the reload."""
        self._subscribers.append(callback)

    def reload(self) -> ReloadResult:
        """Validate → compile → build → swap. Any error keeps the old policy serving."""
        self.reloads += 1
        self.last_reload_at = time.time()
        try:
            compiled = compile_policy(load_policy(self.path))
            if compiled.version == self.version:
                result = ReloadResult(True, False, self.version)
                metrics.POLICY_RELOADS.labels("unchanged").inc()
            else:
                active = self._build(compiled)
                # Only plain assignments from here on: nothing can fail halfway through the swap.
                self._active, self._compiled = active, compiled
                metrics.POLICY_INFO.remove(self.version)
                metrics.POLICY_INFO.labels(compiled.version).set(1)
                log.info("policy reloaded: %s -> %s", self.version, compiled.version)
                self.version = compiled.version
                self.loaded_at = self.last_reload_at
                result = ReloadResult(True, True, compiled.version)
                metrics.POLICY_RELOADS.labels("ok").inc()
        except PolicyError as e:
            result = self._failed(tuple(e.errors))
        except Exception as e:  # a bug in compile/build must not take the serving policy down
            log.exception("policy build failed")
            result = self._failed(
                (f"{self.path}:1:1: cannot build policy: {type(e).__name__}: {e}",)
            )
        metrics.POLICY_LAST_RELOAD_OK.set(1 if result.ok else 0)
        self.last_result = result
        if result.changed:
            for callback in self._subscribers:
                try:
                    callback()
                except Exception:  # a subscriber's bug must not undo a good reload
                    log.exception("policy swap subscriber failed")
        return result

    def _failed(self, errors: tuple[str, ...]) -> ReloadResult:
        self.last_errors = errors
        self.last_error_at = self.last_reload_at
        metrics.POLICY_RELOADS.labels("error").inc()
        log.error("policy reload rejected, %s keeps serving:\n%s", self.version, "\n".join(errors))
        return ReloadResult(False, False, self.version, errors)

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
                "errors": list(r.errors),
                "at": self.last_reload_at,
            },
            "last_error": {"errors": list(self.last_errors), "at": self.last_error_at},
        }
