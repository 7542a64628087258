"""(compiled) When a cached key set (JWKS) is fetched again, and whether it may still be used. Pure:
`now` (monotonic seconds) and a uniform random `u` in [0, 1) come in, times and booleans go out.

- After a good fetch the next one is due after `ttl`, 0-10 % early (so replicas that started
  together drift apart instead of fetching in step).
- After `n` failures in a row it is due after `min(backoff_max, backoff_min * 2**(n-1))`,
  scaled by 50-100 % (jitter), and never later than the `ttl` schedule would be.
- A set may be used until `max_stale` after it was fetched; then it is dropped (fail closed).
- A token with an unknown `kid` may trigger a fetch only when `cooldown` has passed since the
  last fetch it triggered.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RefreshParams:
    ttl: float
    max_stale: float
    cooldown: float
    backoff_min: float = 1.0
    backoff_max: float = 60.0


def after_success(p: RefreshParams, now: float, u: float) -> float:
    return now + p.ttl * (1.0 - 0.1 * u)


def after_failure(p: RefreshParams, now: float, failures: int, u: float) -> float:
    step = min(p.backoff_max, p.backoff_min * 2.0 ** max(0, min(failures - 1, 30)))
    return now + min(step, p.ttl) * (0.5 + 0.5 * u)


def usable(p: RefreshParams, fetched_at: float | None, now: float) -> bool:
    return fetched_at is not None and now - fetched_at <= p.max_stale


def miss_may_fetch(p: RefreshParams, last_miss_fetch: float | None, now: float) -> bool:
    return last_miss_fetch is None or now - last_miss_fetch >= p.cooldown
