"""(compiled) The `rate_limits:` section compiled once per policy: key extractors, rule numbers,
priority.

Pure. A rule's *identity* (`CompiledRule.ident`) is its name, key parts and numbers (qps,
window, tokens per second, burst): a reload that leaves it alone finds the rule's buckets where
they were; a rule whose identity changed starts from fresh buckets (full) and empty windows.
`enforce`, `strict` and `on_overrun` are not part of it: switching them keeps the counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.core.keys import KeyFn, compile_key, needs
from gateway.core.keystate import RuleMath
from gateway.core.overload import Thresholds
from gateway.policy.compiled import CompiledPolicy
from gateway.policy.ratelimits import RateLimits, RateRule, RedisStoreOptions
from gateway.policy.store import effective_store, limits_store
from gateway.store.base import KeyParams


@dataclass(frozen=True, slots=True)
class CompiledRule:
    name: str
    ident: str
    key: KeyFn
    key_parts: tuple[str, ...]
    late: bool  # the key names the model: decided in the body phase (HTTP)
    needs_route: bool
    math: RuleMath
    params: KeyParams
    enforce: bool
    strict: bool
    cut: bool  # on_overrun: cut
    has_q: bool  # a request limit (math.limit > 0)
    has_t: bool  # a token budget (math.rate > 0)


@dataclass(frozen=True, slots=True)
class PriorityFn:
    kind: str  # "claim" | "header"
    name: str
    classes: Mapping[str, int]
    default: int

    def of(self, headers: Mapping[str, str], claims: Mapping[str, Any] | None) -> int:
        if self.kind == "header":
            v: Any = headers.get(self.name)
        else:
            v = claims.get(self.name) if claims is not None else None
        if v is None:
            return self.default
        return self.classes.get(v if isinstance(v, str) else str(v), self.default)


@dataclass(frozen=True, slots=True)
class ClampedPriority:
    """`admission.priority`: the class a client asks for in `header` (a class name or number),
    clamped to the ceiling its claim (or the ceiling's default) allows: lower freely, never
    above the ceiling; no header (or an unknown value) gives the ceiling itself."""

    ceiling: PriorityFn
    header: str  # lower-case
    names: Mapping[str, int]  # lower-case class names
    lowest: int

    def of(self, headers: Mapping[str, str], claims: Mapping[str, Any] | None) -> int:
        c = self.ceiling.of(headers, claims)
        v = headers.get(self.header)
        if v is None:
            return c
        v = v.strip().lower()
        asked = self.names.get(v)
        if asked is None:
            if not v.isdigit() or len(v) > 3:
                return c
            asked = min(int(v), self.lowest)
        return asked if asked > c else c


def priority_of(policy: CompiledPolicy) -> tuple[PriorityFn | ClampedPriority | None, int, int]:
    """The effective class every filter uses (limits, colours, shedding, the queue), with the
    highest and lowest class: `admission.priority` clamped, else `rate_limits.priority`."""
    a = policy.policy.admission
    rl = policy.policy.rate_limits
    p = a.priority.ceiling if a is not None and a.priority is not None else None
    if p is None and rl is not None:
        p = rl.priority
    if p is None:
        return None, 0, 0
    kind, _, name = p.source.partition(":")
    fn = PriorityFn(kind, name.lower() if kind == "header" else name, p.classes, p.default)
    values = [*p.classes.values(), p.default]
    top, lowest = min(values), max(values)
    if a is not None and a.priority is not None:
        names = {k.lower(): v for k, v in p.classes.items()}
        return ClampedPriority(fn, a.priority.header.lower(), names, lowest), top, lowest
    return fn, top, lowest


@dataclass(frozen=True, slots=True)
class CompiledLimits:
    section: RateLimits
    rules: tuple[CompiledRule, ...]
    early: tuple[CompiledRule, ...]  # decided in on_request
    late: tuple[CompiledRule, ...]  # decided in on_body (model-keyed)
    priority: PriorityFn | ClampedPriority | None
    top: int  # the highest class (0 unless the classes say otherwise)
    lowest: int
    needs_route: bool
    pool_of_route: Mapping[str, str]  # route name -> backend pool (concurrency)
    has_tokens: bool
    cut: bool  # some rule cuts overrunning streams
    queued: bool  # `admission` queues at the pools' limits: no refusal there
    room: int  # the admission queue's `max_queued` (0: no queue)
    # The Redis the limits share (`rate_limits.store`, else the top-level `store`); None: memory.
    store: RedisStoreOptions | None = None
    fleet_store: RedisStoreOptions | None = None  # the fleet's (`effective_store`)


def _rule(r: RateRule, s: RateLimits, th: Thresholds) -> CompiledRule:
    math = RuleMath.of(
        r.qps,
        r.window_s,
        r.tokens_per_second,
        r.burst_tokens,
        s.weights.qps,
        s.weights.tokens,
        s.admit_below,
        th,
    )
    params = KeyParams(
        math.limit, math.window_s, math.rate, math.burst,
        math.weights.q, math.weights.t, s.admit_below,
    )  # fmt: skip
    parts = tuple(r.key)
    ident = f"{r.name}|{','.join(parts)}|{params.digest}"
    late = "model" in needs(parts)
    return CompiledRule(
        name=r.name,
        ident=ident,
        key=compile_key(parts),
        key_parts=parts,
        late=late,
        needs_route="route" in needs(parts),
        math=math,
        params=params,
        enforce=r.enforce,
        strict=r.strict,
        cut=r.on_overrun == "cut",
        has_q=math.has_q,
        has_t=math.has_t,
    )


def pool_name(backends: list[str]) -> str:
    """A route's backend pool: its backend, or its backends joined (a split route)."""
    return "+".join(sorted(set(backends)))


def compile_limits(section: RateLimits, policy: CompiledPolicy) -> CompiledLimits:
    o = section.overload
    th = Thresholds(o.green_below, o.yellow_above, o.red_above)
    rules = tuple(_rule(r, section, th) for r in section.rules)
    prio, top, lowest = priority_of(policy)
    pools: dict[str, str] = {}
    for r in policy.policy.routes:
        names = [r.backend] if r.backend else [w.backend for w in r.backends]
        pools[r.name] = pool_name([n for n in names if n])
    return CompiledLimits(
        section=section,
        rules=rules,
        early=tuple(r for r in rules if not r.late),
        late=tuple(r for r in rules if r.late),
        priority=prio,
        top=top,
        lowest=lowest,
        needs_route=any(r.needs_route for r in rules) or section.concurrency is not None,
        pool_of_route=pools,
        has_tokens=any(r.has_t for r in rules),
        cut=any(r.cut and r.has_t for r in rules),
        queued=policy.policy.admission is not None,
        room=policy.policy.admission.queue.max_queued if policy.policy.admission else 0,
        store=limits_store(policy.policy.store, section),
        fleet_store=effective_store(policy.policy.store, section),
    )
