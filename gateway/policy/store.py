"""The top-level `store:` section: the one shared store every feature that must hold across
replicas uses (rate limits, backend slots, fairness counters, ...).

`store: {redis: {...}}` takes the options `rate_limits.store` has always had; a policy that
names its store only under `rate_limits.store` keeps working (that store is then the fleet's).
Both set and different is an error at `rate_limits.store` (`store_errors`). Nothing here does
I/O; `gateway.fleet.store` owns the connection.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from gateway.policy.base import Loc, PolicyModel
from gateway.policy.ratelimits import RedisStoreOptions


class SharedStore(PolicyModel):
    redis: RedisStoreOptions = Field(
        description="the Redis every replica shares: announcement of live replicas, leased "
        "backend slots, shared rate limits and fairness counters"
    )


def effective_store(store: SharedStore | None, rate_limits: Any) -> RedisStoreOptions | None:
    """The store the fleet uses: the top-level `store`, else `rate_limits.store` when it names
    Redis, else none (every replica on its own)."""
    if store is not None:
        return store.redis
    rl_store = getattr(rate_limits, "store", None) if rate_limits is not None else None
    redis = getattr(rl_store, "redis", None)
    return redis if isinstance(redis, RedisStoreOptions) else None


def store_errors(store: SharedStore | None, rate_limits: Any) -> list[tuple[Loc, str]]:
    """`store` and `rate_limits.store` both naming Redis, differently: which one would the
    limits use? Refused rather than guessed."""
    if store is None or rate_limits is None:
        return []
    redis = getattr(getattr(rate_limits, "store", None), "redis", None)
    if isinstance(redis, RedisStoreOptions) and redis != store.redis:
        return [
            (
                ("rate_limits", "store"),
                "differs from the top-level `store`: remove it (the rate limits use the "
                "top-level store) or make both the same",
            )
        ]
    return []


def limits_store(store: SharedStore | None, rate_limits: Any) -> RedisStoreOptions | None:
    """The store the rate limits share their budgets through: `rate_limits.store` when it is
    written (`memory` keeps every limit per process even with a fleet store), else the
    top-level `store`."""
    if rate_limits is not None and "store" in rate_limits.model_fields_set:
        redis = getattr(rate_limits.store, "redis", None)
        return redis if isinstance(redis, RedisStoreOptions) else None
    return store.redis if store is not None else None
