"""(compiled) What the rate-limit filter's request phase offers its other phases: the `Ticket` one
request holds, the `RuleStep` one rule's decision is, and `Steps`, the narrow public steps that the
waiting paths (`ratelimit_wait`) and the token phases (`ratelimit_tokens`) take.
`gateway.filters.ratelimit.RateLimitFilter` implements `Steps`; the other modules see only
this, so none of them imports the filter."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from gateway.context import RequestContext, Status
from gateway.core.keystate import Code, KeyState
from gateway.core.tokens import Reservation
from gateway.ratelimit.compiled import CompiledLimits, CompiledRule
from gateway.ratelimit.owner import Limiter
from gateway.ratelimit.state import PoolState, RuleState

Rule = tuple[CompiledRule, RuleState]


class Ticket:
    """What one request holds of the limiter (in `ctx.reservation`)."""

    __slots__ = ("entries", "tokens", "pool", "prio", "claims", "route", "strict")

    def __init__(
        self,
        prio: int,
        claims: Any,
        route: str | None,
        entries: list[tuple[RuleState, str, KeyState]] | None = None,
    ) -> None:
        self.entries = entries if entries is not None else []  # keys of the rules that admitted it
        self.tokens: Reservation | None = None
        self.pool: PoolState | None = None
        self.prio = prio
        self.claims = claims
        self.route = route
        self.strict: list[Rule] | None = None  # strict rules left for Redis to decide


class RuleStep:
    """One rule's decision for one request: the rule, its state, the key's state, the decision
    (`code`) and when it was made. A request that waits for room decides again on the same step."""

    __slots__ = ("rule", "rs", "ks", "code", "now")

    def __init__(
        self, rule: CompiledRule, rs: RuleState, ks: KeyState, code: Code, now: float
    ) -> None:
        self.rule = rule
        self.rs = rs
        self.ks = ks
        self.code = code
        self.now = now


class Steps(Protocol):
    """The rate-limit filter's request-phase steps, for the phases that continue its work."""

    lim: Limiter
    c: CompiledLimits
    now: Callable[[], float]
    late: tuple[Rule, ...]  # model-keyed rules, decided in the body phase
    delay_s: float  # the longest a request waits in the yellow queue
    default_max: int  # the completion tokens reserved when the request names none
    trailer: str  # the gRPC trailing metadata that carries the usage

    def resume(
        self, ctx: RequestContext, t: Ticket, rules: tuple[Rule, ...], start: int
    ) -> Status | Awaitable[Status]:
        """The per-rule steps for `rules[start:]` of a request that holds `t`, then its
        admission (or refusal)."""
        ...

    def judge(
        self, ctx: RequestContext, t: Ticket, step: RuleStep, rules: tuple[Rule, ...], i: int
    ) -> Status | Awaitable[Status] | None:
        """What a rule's decision `step.code` means for the request (shed, shadow, queue,
        refuse); None: admitted by this rule, go on with the next (`rules[i + 1]`)."""
        ...

    def refuse(self, ctx: RequestContext, t: Ticket, step: RuleStep) -> Status:
        """Refuse the request for `step.rule` (what it held is given back, the refusal counted)."""
        ...

    def admitted(self, ctx: RequestContext, t: Ticket) -> Status:
        """Every rule admitted the request: it holds `t` (and its pool's slot) from now on."""
        ...

    def recoloured(self, rs: RuleState, k: str, ks: KeyState) -> None:
        """Key `k` changed colour (`ks.changed` is the old one): noted and reported."""
        ...

    def reserve(self, ctx: RequestContext, t: Ticket, cost: int, prompt: int) -> Status:
        """Reserve `cost` tokens on every token rule that admitted the request, or refuse it."""
        ...
