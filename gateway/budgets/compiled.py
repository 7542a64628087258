"""(compiled) The `budgets:` section compiled once per policy: key extractors, periods, weights,
amounts.

Pure but for `amounts: {file: ...}`, read here (at each policy load). A rule's identity
(`ident`: name, key parts, period) names its tallies: a reload that keeps it keeps them; one
that changes the key or the period starts new tallies (the old ones stay in the store until
their period ends). The amount (`tokens`, a claim's value, the file) is not part of it: a new
amount applies to the running period at once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gateway.core.budgets import Cost, Period, Weights, cost, parse_duration
from gateway.core.keys import KeyFn, compile_key
from gateway.errors import PolicyError
from gateway.policy.budgets import BudgetRule, Budgets

MAX_AMOUNTS: Final = 1_000_000  # keys an amounts file may name


@dataclass(frozen=True, slots=True)
class CompiledBudget:
    name: str
    ident: str
    key: KeyFn
    key_parts: tuple[str, ...]
    needs_route: bool
    tokens: int
    period: Period
    cost: Cost
    claim: str  # amounts from this claim ("" none)
    header: str  # amounts from this header ("" none)
    amounts: Mapping[str, int]  # amounts from the file
    warn_at: tuple[float, ...]
    closed: bool  # when_store_down: closed
    enforce: bool
    dynamic: bool  # the amount depends on the key or the request (a claim, a header, a file)

    def limit(self, key: str, claims: Mapping[str, Any] | None, headers: Mapping[str, str]) -> int:
        """The key's budget: the claim's (or header's) integer value, the file's, or `tokens`."""
        v: Any = None
        if self.claim:
            v = claims.get(self.claim) if claims is not None else None
        elif self.header:
            v = headers.get(self.header)
        elif self.amounts:
            return self.amounts.get(key, self.tokens)
        if v is not None and not isinstance(v, bool):
            try:
                n = int(v)
            except (TypeError, ValueError):
                return self.tokens
            if 0 < n <= 10**15:
                return n
        return self.tokens


@dataclass(frozen=True, slots=True)
class CompiledBudgets:
    section: Budgets
    rules: tuple[CompiledBudget, ...]
    needs_route: bool


def read_amounts(path: str) -> dict[str, int]:
    """A YAML (or JSON) mapping key → positive integer tokens; PolicyError otherwise."""
    import yaml

    try:
        text = Path(path).read_text()
        doc = yaml.safe_load(text) if not path.endswith(".json") else json.loads(text)
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise PolicyError([f"{path}: cannot read the amounts file: {e}"]) from None
    if not isinstance(doc, dict) or len(doc) > MAX_AMOUNTS:
        raise PolicyError([f"{path}: an amounts file maps keys to tokens (at most {MAX_AMOUNTS})"])
    out: dict[str, int] = {}
    for k, v in doc.items():
        if type(v) is not int or v <= 0:
            raise PolicyError([f"{path}: {k!r}: a budget is a positive integer of tokens"])
        out[str(k)] = v
    return out


def _period(rule: BudgetRule) -> Period:
    p = rule.period
    if p.rolling is not None:
        return Period(rolling_s=parse_duration(p.rolling))
    assert p.calendar is not None
    return Period(calendar=p.calendar, timezone=p.timezone)


def compile_rule(rule: BudgetRule) -> CompiledBudget:
    period = _period(rule)
    c = rule.cost
    weights = cost(
        Weights(c.input, c.output), {m: Weights(w.input, w.output) for m, w in c.models.items()}
    )
    ident_src = json.dumps([rule.name, rule.key, period.calendar, period.timezone,
                            period.rolling_s])  # fmt: skip
    ident = hashlib.sha256(ident_src.encode()).hexdigest()[:12]
    claim = header = ""
    amounts: Mapping[str, int] = {}
    if rule.amounts is not None:
        src = rule.amounts.source
        if src is not None:
            kind, _, name = src.partition(":")
            if kind == "claim":
                claim = name
            else:
                header = name.lower()
        elif rule.amounts.file is not None:
            amounts = read_amounts(rule.amounts.file)
    return CompiledBudget(
        rule.name, ident, compile_key(rule.key), tuple(rule.key), "route" in rule.key,
        rule.tokens, period, weights, claim, header, amounts, tuple(rule.warn_at),
        rule.when_store_down == "closed", rule.enforce, bool(claim or header or amounts),
    )  # fmt: skip


def compile_budgets(section: Budgets) -> CompiledBudgets:
    rules = tuple(compile_rule(r) for r in section.rules)
    return CompiledBudgets(section, rules, any(r.needs_route for r in rules))


def amounts_errors(section: Budgets | None) -> list[tuple[tuple[str | int, ...], str]]:
    """Each amounts file that does not load, at its field (`sluice policy check`)."""
    out: list[tuple[tuple[str | int, ...], str]] = []
    rules: Sequence[BudgetRule] = section.rules if section is not None else ()
    for i, r in enumerate(rules):
        if r.amounts is not None and r.amounts.file is not None:
            try:
                read_amounts(r.amounts.file)
            except PolicyError as e:
                out.append((("budgets", "rules", i, "amounts", "file"), "; ".join(e.errors)))
    return out
