"""(compiled) A budget rule's ledgers, one `Entry` per key and period, and the `RuleBook` that
holds them: what the budget filter reads and moves on every request, kept apart from the owner
(`gateway.budgets.owner`, interpreted: the sync loop and the commands) so that the request path
reads their fields natively.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict

from gateway.budgets.compiled import CompiledBudget
from gateway.budgets.store import Msg
from gateway.core.budgets import Ledger
from gateway.telemetry import metrics
from gateway.telemetry.tally import CountTally


class Entry:
    """One key of one rule in one period: its ledger and its sync state."""

    __slots__ = (
        "key", "ledger", "rkey", "seq", "pending", "need", "event", "last_sync", "last_use",
        "dirty", "length", "exhausted", "flow", "low",
    )  # fmt: skip

    def __init__(self, key: str, ledger: Ledger, rkey: str, length: float) -> None:
        self.key = key
        self.ledger = ledger
        self.rkey = rkey  # its hash in the store
        self.seq = 0
        self.pending: Msg | None = None  # sent, reply not seen yet (sent again as it is)
        self.need = 0  # requests wait for this much free share (their sum)
        self.exhausted = False  # the store's last answer gave less than was asked
        self.flow = 0  # tokens used per sync interval, lately (sizes the share)
        self.low = 1  # below this free share, sync at once
        self.event: asyncio.Event | None = None
        self.last_sync = 0.0
        self.last_use = 0.0
        self.dirty = False
        self.length = length  # the period's length (s), for the hash's expiry


class RuleBook:
    """A rule's ledgers (LRU, at most `max_keys`) and counts."""

    def __init__(self, rule: CompiledBudget) -> None:
        self.rule = rule
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.counts: Counter[str] = Counter()
        self.tokens = CountTally(metrics.BUDGET_TOKENS.labels(rule.name))  # charged, weighted
