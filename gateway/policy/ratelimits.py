"""The `rate_limits:` policy section: rules, priority classes, the overload colours, the store.

Defaults are the golden parameters of the design (pressure 0.6 · QPS + 0.4 · tokens, admit
while < 0.95; green < 0.80, yellow > 0.85, red > 0.95; Redis deadline 20 ms). Nothing here does
I/O; `gateway.ratelimit.compiled` turns a valid section into what the request path uses.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from gateway.policy.base import PolicyModel, fill_ordered

KEY_PART = re.compile(
    r"^(claim:[A-Za-z0-9_.\-]{1,64}|header:[A-Za-z0-9_\-]{1,64}"
    r"|source_ip|client_cert|route|model)$"
)


KeyPart = Annotated[
    str,
    Field(
        pattern=KEY_PART.pattern,
        description="claim:NAME (a verified JWT claim), header:NAME (request header / gRPC "
        "metadata), source_ip, client_cert (the verified mTLS client certificate's identity), "
        "route (the matched route's name), model (HTTP body `model`)",
    ),
]


class RedisStoreOptions(PolicyModel):
    url: str = Field(
        default="redis://127.0.0.1:6379/0",
        pattern=r"^rediss?://",
        description="redis:// or rediss:// URL (for a Cluster: any node's address)",
    )
    cluster: bool = Field(default=False, description="the URL names a Redis Cluster node")
    deadline_ms: PositiveFloat = Field(
        default=20.0,
        le=5000,
        description="hard deadline of a Redis call a request waits for (strict rules); past "
        "it the rule decides locally. Background syncs get max(deadline_ms, sync_interval_ms)",
    )
    sync_interval_ms: PositiveFloat = Field(
        default=50.0,
        ge=5,
        le=10000,
        description="how often leased shares are reconciled with Redis (one pipelined round trip "
        "for all active keys); sooner when a share runs low",
    )
    connect_timeout_ms: PositiveFloat = Field(
        default=500.0,
        le=30000,
        description="budget of a background (re)connect attempt; requests never wait for it",
    )
    key_prefix: str = Field(
        default="sluice", pattern=r"^[A-Za-z0-9_.\-]{1,32}$", description="prefix of every key"
    )
    replica_ttl_s: PositiveFloat = Field(
        default=5.0,
        description="a replica not heard from for this long no longer counts in the fallback "
        "sizing (limit / live replicas)",
    )


class RedisStore(PolicyModel):
    redis: RedisStoreOptions = Field(description="share limits between replicas through Redis")


class FromSource(PolicyModel):
    """A value read from each request: a verified claim or a header (`from:`)."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, allow_inf_nan=False, populate_by_name=True
    )

    source: str = Field(
        alias="from",
        pattern=r"^(claim:[A-Za-z0-9_.\-]{1,64}|header:[A-Za-z0-9_\-]{1,64})$",
        description="claim:NAME or header:NAME whose value is read",
    )


class Priority(FromSource):
    """Where a request's priority class comes from (`from`: the value names the class). 0 is
    the highest; the highest number in `classes` is the lowest class (shed first in yellow)."""

    classes: dict[str, Annotated[int, Field(ge=0, le=100)]] = Field(
        min_length=1, description="class name -> priority (0 = highest)"
    )
    default: int = Field(ge=0, le=100, description="priority of a request without a known class")


class Weights(PolicyModel):
    qps: float = Field(default=0.6, ge=0, le=1, description="weight of QPS utilisation")
    tokens: float = Field(default=0.4, ge=0, le=1, description="weight of token utilisation")

    @model_validator(mode="after")
    def _positive(self) -> Weights:
        if self.qps + self.tokens <= 0:
            raise ValueError("at least one weight must be above 0")
        return self


class Overload(PolicyModel):
    """The overload colour of each key (and of each backend pool), with hysteresis."""

    green_below: float = Field(
        default=0.80, gt=0, le=2, description="green again when both signals are below this"
    )
    yellow_above: float = Field(
        default=0.85, gt=0, le=2, description="yellow when any signal is above this"
    )
    red_above: float = Field(
        default=0.95, gt=0, le=2, description="red when both signals are above this"
    )
    yellow_delay_ms: float = Field(
        default=50.0,
        ge=0,
        le=10000,
        description="in yellow, a request the limiter would refuse waits up to this long for "
        "room (bounded queue) before it is refused; 0 = refuse at once",
    )
    queue_size: int = Field(
        default=256, ge=0, le=100000, description="requests that may wait at once (per process)"
    )
    red_deny: bool = Field(
        default=False,
        description="in red, hand sources that keep arriving to the kernel datapath's deny list "
        "(needs `datapath.enabled`)",
    )
    red_deny_after: PositiveInt = Field(
        default=100, description="shed requests from one source (while red) before it is denied"
    )
    red_deny_ttl_s: PositiveFloat | None = Field(
        default=None, description="how long it stays denied (default: datapath.deny_ttl_s)"
    )

    @model_validator(mode="after")
    def _ordered(self) -> Overload:
        # One threshold written alone moves the defaults of the others out of its way.
        fill_ordered(self, ("green_below", "yellow_above", "red_above"))
        if not self.green_below <= self.yellow_above <= self.red_above:
            raise ValueError("need green_below <= yellow_above <= red_above")
        return self


class Concurrency(PolicyModel):
    """Adaptive concurrency limit per backend pool: a latency gradient anchored to the SLO
    (no probing windows). Its utilisation (in flight / limit) is the pool's overload signal."""

    latency_slo_ms: PositiveFloat = Field(
        default=500.0, description="target time to first byte (the design's p95 latency SLI)"
    )
    initial_limit: PositiveInt = Field(default=64, description="limit before any sample")
    min_limit: PositiveInt = Field(default=4, description="the limit never goes below this")
    max_limit: PositiveInt = Field(default=1000, description="the limit never goes above this")
    smoothing: float = Field(
        default=0.2, gt=0, le=1, description="how far one update moves the limit toward target"
    )

    @model_validator(mode="after")
    def _bounds(self) -> Concurrency:
        fill_ordered(self, ("min_limit", "initial_limit", "max_limit"))
        if not self.min_limit <= self.initial_limit <= self.max_limit:
            raise ValueError("need min_limit <= initial_limit <= max_limit")
        return self


class RateRule(PolicyModel):
    name: str = Field(
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.\-]+$",
        description="metrics label; state is kept per name (and parameters) across reloads",
    )
    key: list[KeyPart] = Field(
        max_length=8,
        description="what one bucket counts: claim:NAME, header:NAME, source_ip, client_cert, "
        "route, model (empty = one bucket for all requests)",
    )
    qps: PositiveFloat | None = Field(
        default=None, description="requests per second (sliding window); null = no request limit"
    )
    window_s: PositiveFloat = Field(
        default=1.0,
        le=3600,
        description="sliding window of the request limit (at least 1/qps: one request fits)",
    )
    tokens_per_second: PositiveFloat | None = Field(
        default=None, description="LLM tokens per second (token bucket); null = no token limit"
    )
    burst_tokens: PositiveFloat | None = Field(
        default=None, description="token bucket size (default: one second of tokens_per_second)"
    )
    enforce: bool = Field(
        default=True, description="false = shadow mode: count would-be rejections, reject nothing"
    )
    strict: bool = Field(
        default=False,
        description="with a Redis store: one Redis decision per request (for low-rate, "
        "high-value keys) instead of a locally leased share",
    )
    on_overrun: Literal["allow", "cut"] = Field(
        default="allow",
        description="a stream that uses more tokens than it reserved: allow (charge the "
        "difference) or cut (end it cleanly)",
    )

    @model_validator(mode="after")
    def _something(self) -> RateRule:
        if self.qps is None and self.tokens_per_second is None:
            raise ValueError("a rule needs qps, tokens_per_second or both")
        if self.burst_tokens is not None and self.tokens_per_second is None:
            raise ValueError("burst_tokens needs tokens_per_second")
        return self


class RateLimits(PolicyModel):
    store: Literal["memory"] | RedisStore = Field(
        default="memory",
        description="memory (one process; with --workers N each process gets 1/N of every "
        "limit) or {redis: {...}} (one limit shared by every replica)",
    )
    priority: Priority | None = Field(
        default=None, description="priority classes (without: one class, nothing shed by colour)"
    )
    rules: list[RateRule] = Field(default_factory=list, max_length=64, description="limits")
    weights: Weights = Field(default_factory=Weights, description="pressure weights")
    admit_below: float = Field(
        default=0.95, gt=0, le=2, description="admit while pressure is below this"
    )
    overload: Overload = Field(default_factory=Overload, description="colours and shedding")
    concurrency: Concurrency | None = Field(
        default=None, description="adaptive concurrency limit per backend pool (null = off)"
    )
    default_max_tokens: int = Field(
        default=1024,
        ge=0,
        le=10_000_000,
        description="completion tokens reserved for a request without max_tokens (and for gRPC)",
    )
    grpc_usage_trailer: str = Field(
        default="x-usage-total-tokens",
        pattern=r"^[a-z0-9_.\-]{1,64}$",
        description="gRPC trailing-metadata key carrying a call's total tokens (an integer)",
    )
    max_keys: PositiveInt = Field(
        default=100_000,
        le=10_000_000,
        description="keys remembered per rule (least recently used go first)",
    )

    @model_validator(mode="after")
    def _unique(self) -> RateLimits:
        names = [r.name for r in self.rules]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate rule name(s): {', '.join(dup)}")
        return self
