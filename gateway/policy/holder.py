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
    version: str
    errors: tuple[str, ...] = ()


class PolicyHolder(Generic[A]):
    def __init__(self, path: Path, build: Callable[[CompiledPolicy], A]) -> None:
        self.path = path
        self._build = build
        compiled = compile_policy(load_policy(path))  # raises PolicyError: fatal at boot
        self._active: A = build(compiled)
        self.version = compiled.version
        self.reloads = 0
        self.last_result = ReloadResult(True, True, compiled.version)
        self.last_reload_at = time.time()
        metrics.POLICY_INFO.labels(compiled.version).set(1)
        metrics.POLICY_LAST_RELOAD_OK.set(1)

    @property
    def active(self) -> A:
        return self._active

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
                self._active = self._build(compiled)
                metrics.POLICY_INFO.remove(self.version)
                metrics.POLICY_INFO.labels(compiled.version).set(1)
                log.info("policy reloaded: %s -> %s", self.version, compiled.version)
                self.version = compiled.version
                result = ReloadResult(True, True, compiled.version)
                metrics.POLICY_RELOADS.labels("ok").inc()
        except PolicyError as e:
            result = ReloadResult(False, False, self.version, tuple(e.errors))
            metrics.POLICY_RELOADS.labels("error").inc()
            log.error("policy reload rejected, %s keeps serving: %s", self.version, e)
        metrics.POLICY_LAST_RELOAD_OK.set(1 if result.ok else 0)
        self.last_result = result
        return result

    def status(self) -> dict[str, object]:
        r = self.last_result
        return {
            "path": str(self.path),
            "version": self.version,
            "reloads": self.reloads,
            "last_reload": {
                "ok": r.ok,
                "changed": r.changed,
                "errors": list(r.errors),
                "at": self.last_reload_at,
            },
        }
