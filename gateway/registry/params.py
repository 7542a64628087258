"""A backend section's breaker, outlier and health settings as the pure cores take them
(`gateway.core.breaker`, `.outlier`, `.health`): made once per view, at policy load."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.core.breaker import BreakerParams
from gateway.core.health import HealthParams
from gateway.core.outlier import OutlierParams

if TYPE_CHECKING:
    from gateway.policy.model import Backend


def breaker_params(b: Backend) -> BreakerParams | None:
    c = b.breaker
    if c is None:
        return None
    return BreakerParams(
        consecutive_failures=c.consecutive_failures,
        error_ratio=c.error_ratio,
        slow_call_s=c.slow_call_s,
        slow_ratio=c.slow_ratio,
        min_requests=c.min_requests,
        window_s=c.window_s,
        open_s=c.open_s,
        max_open_s=c.max_open_s,
        half_open_probes=c.half_open_probes,
        probe_timeout_s=c.probe_timeout_s if c.probe_timeout_s is not None else c.slow_call_s,
    )


def outlier_params(b: Backend) -> OutlierParams | None:
    c = b.outlier
    if c is None:
        return None
    return OutlierParams(
        c.timeout_ratio, c.window_s, c.min_requests, c.max_ejected, c.ejection_s, c.max_ejection_s
    )


def health_params(b: Backend) -> HealthParams | None:
    c = b.health
    if c is None:
        return None
    return HealthParams(
        c.interval_s, c.failing_interval_s, c.jitter, c.timeout_s, c.unhealthy_after,
        c.healthy_after,
    )  # fmt: skip
