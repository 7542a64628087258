"""The `budgets:` policy section: token budgets per key over calendar or fixed-length periods.

Nothing here does I/O; `gateway.budgets.compiled` turns a valid section into what the request
path uses (and reads an `amounts: {file: ...}` map). The store that shares a budget between
replicas is the fleet's (the top-level `store:`); without one, each replica keeps its own
tallies.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, PositiveFloat, PositiveInt, field_validator, model_validator

from gateway.core.budgets import CALENDAR, parse_duration
from gateway.policy.base import Loc, PolicyModel
from gateway.policy.ratelimits import KeyPart

TOKENS_MAX = 10**15


class BudgetPeriod(PolicyModel):
    """`{calendar: day|week|month, timezone: ZONE}` or `{rolling: DURATION}`."""

    calendar: Literal["day", "week", "month"] | None = Field(
        default=None,
        description="a calendar period (a week starts on Monday), reset at midnight in `timezone`",
    )
    timezone: str = Field(
        default="UTC",
        min_length=1,
        max_length=64,
        description="IANA time zone of a calendar period (e.g. Europe/Paris; daylight saving "
        "moves the reset with the clock)",
    )
    rolling: str | None = Field(
        default=None,
        description="a fixed-length period: consecutive windows of this length (10s, 15m, 12h, "
        "30d, 2w) counted from the Unix epoch, the same on every replica",
        examples=["30d"],
    )

    @field_validator("rolling")
    @classmethod
    def _duration(cls, v: str | None) -> str | None:
        if v is not None:
            parse_duration(v)
        return v

    @field_validator("timezone")
    @classmethod
    def _zone(cls, v: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(v)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(
                f"unknown time zone {v!r} (an IANA name such as UTC or Europe/Paris)"
            ) from None
        return v

    @model_validator(mode="after")
    def _one(self) -> BudgetPeriod:
        if (self.calendar is None) == (self.rolling is None):
            raise ValueError("a period is either {calendar: day|week|month} or {rolling: 30d}")
        if self.rolling is not None and "timezone" in self.model_fields_set:
            raise ValueError("timezone applies to calendar periods only")
        return self


assert CALENDAR == ("day", "week", "month")


class BudgetWeights(PolicyModel):
    input: float = Field(default=1.0, ge=0, le=1000, description="cost of one prompt token")
    output: float = Field(default=1.0, ge=0, le=1000, description="cost of one completion token")


class BudgetCost(BudgetWeights):
    models: dict[str, BudgetWeights] = Field(
        default_factory=dict,
        max_length=1000,
        description="weights of the models named here (by the body's `model`); others use "
        "`input` and `output`",
    )


class BudgetAmounts(PolicyModel):
    """Per-key budgets: from a verified claim (or header) of each request, or from a file."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, allow_inf_nan=False, populate_by_name=True
    )

    source: str | None = Field(
        default=None,
        alias="from",
        pattern=r"^(claim:[A-Za-z0-9_.\-]{1,64}|header:[A-Za-z0-9_\-]{1,64})$",
        description="claim:NAME (or header:NAME) whose integer value is the key's budget in "
        "tokens; a request without it (or with a value that is not a positive integer) gets "
        "`tokens`",
    )
    file: str | None = Field(
        default=None,
        min_length=1,
        description="a YAML or JSON file mapping each key (as `sluice budget show` prints it) "
        "to its budget in tokens; keys it does not name get `tokens`. Read at each policy load",
    )

    @model_validator(mode="after")
    def _one(self) -> BudgetAmounts:
        if (self.source is None) == (self.file is None):
            raise ValueError("amounts takes either `from: claim:NAME` or `file: PATH`")
        return self


class BudgetRule(PolicyModel):
    name: str = Field(
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.\-]+$",
        description="the budget's name (headers, metrics, `sluice budget`); tallies are kept "
        "per name, key and period",
    )
    key: list[KeyPart] = Field(
        max_length=8,
        description="whose budget: claim:NAME, header:NAME, source_ip, client_cert, route "
        "(empty = one budget for all requests)",
    )
    tokens: PositiveInt = Field(
        le=TOKENS_MAX, description="tokens per period and key (unless `amounts` says otherwise)"
    )
    period: BudgetPeriod = Field(description="when the budget starts over")
    cost: BudgetCost = Field(
        default_factory=BudgetCost, description="weights of prompt and completion tokens"
    )
    amounts: BudgetAmounts | None = Field(
        default=None, description="per-key budgets (null: `tokens`)"
    )
    warn_at: list[float] = Field(
        default_factory=list,
        max_length=8,
        description="fractions of the budget (0 < f < 1) at which a warning goes into the "
        "response header `x-sluice-budget-warning`, a metric and the access log",
    )
    when_store_down: Literal["open", "closed"] = Field(
        default="open",
        description="the store unreachable: open = admit, tally locally and settle once it is "
        "back; closed = refuse with 503 what the replica's leased share cannot cover",
    )
    enforce: bool = Field(
        default=True, description="false = shadow mode: count would-be refusals, refuse nothing"
    )

    @field_validator("key")
    @classmethod
    def _not_model(cls, v: list[str]) -> list[str]:
        if "model" in v:
            raise ValueError(
                "a budget is keyed before the body is read: use claims, headers, "
                "source_ip, client_cert or route (weigh models with `cost.models`)"
            )
        return v

    @field_validator("warn_at")
    @classmethod
    def _fractions(cls, v: list[float]) -> list[float]:
        for f in v:
            if not 0 < f < 1:
                raise ValueError(f"warn_at fractions lie between 0 and 1 (exclusive); got {f}")
        return sorted(set(v))


class Budgets(PolicyModel):
    rules: list[BudgetRule] = Field(
        default_factory=list, max_length=64, description="token budgets"
    )
    default_max_tokens: int = Field(
        default=1024,
        ge=0,
        le=10_000_000,
        description="completion tokens reserved for a request that names no max_tokens",
    )
    share_tokens: PositiveInt | None = Field(
        default=None,
        le=TOKENS_MAX,
        description="with a store: the share of a key's budget a replica leases at a time "
        "(default: 8 requests' reservations, or twice a busy key's use per sync interval, at "
        "most 1/16 of the budget)",
    )
    wait_ms: PositiveFloat = Field(
        default=100.0,
        le=5000,
        description="with a store: the longest a request waits for a share when its replica's "
        "local share cannot cover it (past it: `when_store_down`)",
    )
    sync_interval_ms: PositiveFloat = Field(
        default=100.0,
        ge=5,
        le=10000,
        description="with a store: how often settled usage is reported and shares renewed (one "
        "pipelined round trip for all active keys); sooner when a share runs low",
    )
    reservation_ttl_s: PositiveFloat = Field(
        default=30.0,
        ge=1,
        le=86400,
        description="with a store: a replica not heard from for this long is dead: its open "
        "reservations count as spent (up to their cap, logged) and its free share returns",
    )
    max_keys: PositiveInt = Field(
        default=100_000,
        le=10_000_000,
        description="keys remembered per rule per replica (least recently used go first; a "
        "key forgotten with a store keeps its tally there)",
    )

    @model_validator(mode="after")
    def _unique(self) -> Budgets:
        names = [r.name for r in self.rules]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate budget name(s): {', '.join(dup)}")
        return self


def budget_errors(b: Budgets | None, filters: list[str]) -> list[tuple[Loc, str]]:
    if b is None or not b.rules:
        return []
    if "budget" not in filters:
        return [(("filters",), "budgets are configured: list 'budget' in filters")]
    if "auth" in filters and filters.index("budget") < filters.index("auth"):
        return [(("filters",), "'budget' must come after 'auth' (budgets are keyed by claims)")]
    return []


def budget_warnings(b: Budgets | None, store: object | None) -> list[tuple[Loc, str]]:
    """`store`: the fleet's effective store (None: every replica on its own)."""
    if b is None or not b.rules or store is not None:
        return []
    return [
        (
            ("budgets",),
            "no top-level `store`: budgets live in memory per replica (each replica enforces "
            "the whole budget alone, and a restart forgets the tallies)",
        )
    ]
