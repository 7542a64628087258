"""The `admission:` policy section: the fair queue in front of each backend pool's concurrency
limit (`gateway.core.fairqueue`), who shares it (tenants, by tokens served), priority classes
with a ceiling a client cannot pass, and deadlines. Nothing here does I/O;
`gateway.filters.admission` compiles a valid section once per policy.

Without this section a pool at its limit refuses (503) as before. The capacity a queue guards is
the pool's `max_in_flight` per member (`backends[].max_in_flight`, × its members in rotation) or,
without it, the adaptive concurrency limit of `rate_limits.concurrency`; a pool with neither has
no limit and never queues.
"""

from __future__ import annotations

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from gateway.policy.base import PolicyModel
from gateway.policy.ratelimits import FromSource, KeyPart, Priority

HEADER = r"^[A-Za-z0-9_\-]{1,64}$"


class Queue(PolicyModel):
    max_wait_ms: PositiveFloat = Field(
        default=5000.0,
        le=600_000,
        description="a request waits at most this long for a slot, else 503 `queue_timeout` "
        "with Retry-After",
    )
    max_queued: PositiveInt = Field(
        default=2000,
        le=1_000_000,
        description="requests waiting per backend pool (per process); beyond it the lowest "
        "class is refused first (503 `queue_full`)",
    )
    anticipate_ms: float = Field(
        default=20.0,
        ge=0,
        le=1000,
        description="a slot freed by a tenant that has nobody waiting, while the fair order "
        "would put the waiters behind it, is held this long for that tenant's next request "
        "(closed-loop clients ask again a few ms after a stream ends); each hold can leave a "
        "slot idle this long (0: never held, a work-conserving queue; the default 20 ms lets a "
        "light tenant's closed-loop clients keep their turn)",
    )


class Cost(PolicyModel):
    input: float = Field(default=1.0, ge=0, le=1000, description="charge per prompt token")
    output: float = Field(default=2.0, ge=0, le=1000, description="charge per generated token")


class WeightSource(FromSource):
    """A tenant's weight: the (numeric) value of a claim or header (`from`)."""

    default: PositiveFloat = Field(
        default=1.0, le=1e6, description="weight of a tenant without a valid value"
    )


class Fairness(PolicyModel):
    key: list[KeyPart] = Field(
        default_factory=lambda: ["claim:tenant"],
        min_length=1,
        max_length=8,
        description="who shares the pool fairly: a tenant is one value of these key parts (as "
        "in rate-limit keys)",
    )
    cost: Cost = Field(
        default_factory=Cost,
        description="a tenant's virtual counter grows by the tokens it was served: prompt × "
        "input + generated × output",
    )
    weights: WeightSource | None = Field(
        default=None,
        description="a tenant's share is its weight ÷ the active tenants' (null: all 1)",
    )
    max_tenants: PositiveInt = Field(
        default=10_000,
        le=1_000_000,
        description="tenant records kept per pool and class; past it the idle ones go, oldest "
        "first, and one that comes back starts at its class's current counter",
    )


class AdmissionPriority(PolicyModel):
    header: str = Field(
        default="x-sluice-priority",
        pattern=HEADER,
        description="a client may ask for a class (its name or number) with this header: a "
        "lower one freely, a higher one only up to its ceiling",
    )
    ceiling: Priority = Field(
        description="the highest class a request may have, from a verified claim (or a header)"
    )
    reserve: Reserve | None = Field(
        default=None, description="slots reserved for the high classes (null: none)"
    )

    @model_validator(mode="after")
    def _known_rank(self) -> AdmissionPriority:
        r = self.reserve
        if r is not None and isinstance(r.rank, str) and r.rank not in self.ceiling.classes:
            raise ValueError(f"reserve.rank {r.rank!r} is not one of ceiling.classes")
        return self

    def reserve_rank(self) -> int:
        """The class number of `reserve.rank` (0 without a reserve)."""
        r = self.reserve
        if r is None:
            return 0
        return self.ceiling.classes[r.rank] if isinstance(r.rank, str) else r.rank


class Reserve(PolicyModel):
    """Slots of each pool only the high classes may take."""

    share: float = Field(
        gt=0,
        le=1,
        description="of each pool's slots (rounded up), only for the classes at or above `rank`; "
        "the others are dispatched only while fewer than the rest are busy, so the reserved "
        "slots stay idle while the high classes ask for less",
    )
    rank: int | str = Field(
        default=0,
        description="the lowest class that may take them: a name of `ceiling.classes` or a "
        "number (0 = the highest)",
    )


class Deadline(PolicyModel):
    header: str = Field(
        default="x-sluice-deadline-ms",
        pattern=HEADER,
        description="milliseconds from arrival by which the client needs its first byte: "
        "earliest deadline first inside a tenant; one that cannot be met is refused at once "
        "(503 `deadline_unreachable`)",
    )


class Admission(PolicyModel):
    """Queue instead of refusing; fair across tenants by tokens, strict between classes."""

    queue: Queue = Field(default_factory=Queue, description="the queue of each backend pool")
    fairness: Fairness = Field(default_factory=Fairness, description="sharing between tenants")
    priority: AdmissionPriority | None = Field(
        default=None,
        description="classes a client may ask for, clamped to its ceiling (null: the class of "
        "`rate_limits.priority`, else 0); the clamped class is what limits, colours, shedding "
        "and the queue use",
    )
    deadline: Deadline | None = Field(
        default=None, description="per-request deadlines from a header (null: none)"
    )
