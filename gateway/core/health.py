"""(compiled) Health of one backend member from active checks: consecutive-result thresholds.

Pure. A member starts healthy (so a new member serves at once; its first check runs right away).
`unhealthy_after` failed checks in a row make it unhealthy, `healthy_after` passing checks in a
row make it healthy again. While it is failing (unhealthy, or any failure since its last pass)
checks run every `failing_interval_s` instead of `interval_s`, each with ±`jitter` spread so a
fleet of gateways does not check in step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HealthParams:
    interval_s: float = 30.0
    failing_interval_s: float = 2.0
    jitter: float = 0.1
    timeout_s: float = 2.0
    unhealthy_after: int = 3
    healthy_after: int = 2


class HealthState:
    __slots__ = ("p", "healthy", "failures", "passes", "checks", "last_error")

    def __init__(self, params: HealthParams) -> None:
        self.p = params
        self.healthy = True
        self.failures = 0  # consecutive failed checks
        self.passes = 0  # consecutive passing checks
        self.checks = 0
        self.last_error = ""

    def observe(self, ok: bool, error: str = "") -> bool:
        """One check's result; True when it changed `healthy`."""
        self.checks += 1
        if ok:
            self.passes += 1
            self.failures = 0
            if not self.healthy and self.passes >= self.p.healthy_after:
                self.healthy = True
                return True
            return False
        self.failures += 1
        self.passes = 0
        self.last_error = error[:200]
        if self.healthy and self.failures >= self.p.unhealthy_after:
            self.healthy = False
            return True
        return False

    @property
    def failing(self) -> bool:
        return not self.healthy or self.failures > 0

    def next_delay(self, u: float) -> float:
        """Seconds until the next check; `u` in [0, 1) spreads it by ±jitter."""
        base = self.p.failing_interval_s if self.failing else self.p.interval_s
        return base * (1.0 + self.p.jitter * (2.0 * u - 1.0))

    def snapshot(self) -> dict[str, object]:
        return {
            "healthy": self.healthy,
            "consecutive_failures": self.failures,
            "consecutive_passes": self.passes,
            "checks": self.checks,
            "last_error": self.last_error,
        }
