"""The budgets' side of Redis: one hash per budget key and period, changed only by two scripts
(`lua/sync.lua`, `lua/admin.lua`), so that no check-then-increment exists anywhere.

A sync message (`Msg`) carries one replica's news about one key: the usage settled since its
last message, the share it gives back, the share it wants, the reservations it holds open (so
that, should it die, they count as spent), and a sequence number: a message whose reply was
lost is sent again with the same number, and the script answers it without applying it twice.
All messages of a round go in one pipelined round trip through the fleet store, under its hard
deadline; every failure is `StoreUnavailable` (and the fleet store's fallback mode until it
reconnects).

Keys: `PREFIX:budget:{RULE-IDENT:KEY-DIGEST}:PERIOD` (the braces are a Cluster hash tag), expiring
a while after their period ends (set when the hash is created).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

from gateway.fleet.store import FleetStore, Script

_LUA = files("gateway.budgets") / "lua"
KEEP_AFTER_S = 86400  # a period's tally stays readable this long after it ends (at most)


SYNC = Script((_LUA / "sync.lua").read_text(), "budget_sync")
ADMIN = Script((_LUA / "admin.lua").read_text(), "budget_admin")


@dataclass(slots=True)
class Msg:
    key: str  # the Redis key
    seq: int
    limit: int
    used: int
    back: int
    want: int
    held: int
    expire_at: int  # Unix s


@dataclass(frozen=True, slots=True)
class Reply:
    granted: int
    used: int  # the store's tally (all replicas)
    reserved: int  # open reservations of all replicas
    left: int  # limit + grants - used - leased shares
    lost: bool  # this replica's lease had expired
    # (replica, tokens it held counted as spent, of which reservations in flight)
    expired: tuple[tuple[str, int, int], ...]


@dataclass(frozen=True, slots=True)
class Figures:
    """A budget key as an operator sees it (`sluice budget show`)."""

    limit: int  # amount + grants
    used: int
    reserved: int
    remaining: int
    granted: int
    expired: int


def redis_key(prefix: str, ident: str, key: str, period: str) -> str:
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return f"{prefix}:budget:{{{ident}:{digest}}}:{period}"


def expire_at(end: float, length: float) -> int:
    """When a period's hash may go: a while after the period's end."""
    return int(end + min(KEEP_AFTER_S, max(60.0, length))) + 1


class BudgetStore:
    """The budget scripts, run through the fleet store (`gateway.fleet.store`), which owns the
    connection, its deadline and its mode."""

    def __init__(self, fleet: FleetStore, ttl_ms: int) -> None:
        self.fleet = fleet
        self.ttl_ms = ttl_ms  # a replica not heard from this long is dead

    @property
    def prefix(self) -> str:
        return self.fleet.prefix

    @property
    def up(self) -> bool:
        return self.fleet.shared

    async def sync(self, msgs: Sequence[Msg]) -> list[Reply]:
        rid, ttl = self.fleet.replica_id, self.ttl_ms
        cmds = [
            ([m.key], [rid, m.seq, m.limit, m.used, m.back, m.want, m.held, ttl, m.expire_at])
            for m in msgs
        ]
        return [_reply(r) for r in await self.fleet.pipeline(SYNC, cmds, op="budget_sync")]

    async def admin(self, key: str, action: str, tokens: int, limit: int, at: int) -> Figures:
        r = await self.fleet.run(ADMIN, [key], [action, tokens, limit, at])
        v = [int(x) for x in r]
        return Figures(v[0], v[1], v[2], v[3], v[4], v[5])


def _reply(r: Any) -> Reply:
    v = list(r)
    expired = tuple(
        (v[i].decode() if isinstance(v[i], bytes) else str(v[i]), int(v[i + 1]), int(v[i + 2]))
        for i in range(6, len(v) - 2, 3)
    )
    return Reply(int(v[0]), int(v[1]), int(v[2]), int(v[3]), bool(int(v[4])), expired)
