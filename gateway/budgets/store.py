"""The budgets' side of Redis: one hash per budget key and period, changed only by two scripts
(`lua/sync.lua`, `lua/admin.lua`), so that no check-then-increment exists anywhere.

A sync message (`Msg`) carries one replica's news about one key: the usage settled since its
last message, the share it gives back, the share it wants, the reservations it holds open (so
that, should it die, they count as spent), and a sequence number: a message whose reply was
lost is sent again with the same number, and the script answers it without applying it twice.
All messages of a round go in one pipelined round trip under a hard deadline; every failure is
`StoreUnavailable`.

Keys: `PREFIX:budget:{RULE-IDENT:KEY-DIGEST}:PERIOD` (the braces are a Cluster hash tag), expiring
a while after their period ends (set when the hash is created).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

from gateway.errors import StoreUnavailable

_LUA = files("gateway.budgets") / "lua"
KEEP_AFTER_S = 86400  # a period's tally stays readable this long after it ends (at most)


class _Script:
    def __init__(self, name: str) -> None:
        self.source = (_LUA / name).read_text()
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()


SYNC = _Script("sync.lua")
ADMIN = _Script("admin.lua")


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
    expired: tuple[tuple[str, int], ...]  # (replica, its reservations counted as spent)


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


def _is_noscript(exc: BaseException) -> bool:
    return "NOSCRIPT" in str(exc) or type(exc).__name__ == "NoScriptError"


class BudgetStore:
    """The budget scripts over the services' shared Redis client (which it does not close)."""

    def __init__(
        self, client: Any, prefix: str, deadline_s: float, replica: str, ttl_ms: int
    ) -> None:
        self.client = client
        self.ttl_ms = ttl_ms  # a replica not heard from this long is dead
        self.prefix = prefix
        self.deadline_s = deadline_s
        self.replica = replica
        self.calls = 0
        self.errors = 0

    async def sync(self, msgs: Sequence[Msg]) -> list[Reply]:
        cmds = [
            (
                [m.key],
                [
                    self.replica,
                    m.seq,
                    m.limit,
                    m.used,
                    m.back,
                    m.want,
                    m.held,
                    self.ttl_ms,
                    m.expire_at,
                ],
            )  # fmt: skip
            for m in msgs
        ]
        return [_reply(r) for r in await self._run(SYNC, cmds)]

    async def admin(self, key: str, action: str, tokens: int, limit: int, at: int) -> Figures:
        (r,) = await self._run(ADMIN, [([key], [action, tokens, limit, at])])
        v = [int(x) for x in r]
        return Figures(v[0], v[1], v[2], v[3], v[4], v[5])

    async def _run(self, script: _Script, cmds: list[tuple[list[str], list[Any]]]) -> list[Any]:
        self.calls += 1
        try:
            async with asyncio.timeout(self.deadline_s):
                replies = await self._pipeline(script.sha, cmds)
                if any(isinstance(r, Exception) and _is_noscript(r) for r in replies):
                    # Redis restarted (scripts are not persisted): load and send again; a
                    # message that did run the first time is answered as a replay.
                    await self.client.script_load(script.source)
                    replies = await self._pipeline(script.sha, cmds)
        except TimeoutError as exc:
            self.errors += 1
            raise StoreUnavailable("redis deadline exceeded") from exc
        except Exception as exc:  # connection refused, reset, loading, ...
            self.errors += 1
            raise StoreUnavailable(f"redis: {type(exc).__name__}: {exc}") from exc
        for r in replies:
            if isinstance(r, Exception):
                self.errors += 1
                raise StoreUnavailable(f"redis: {type(r).__name__}: {r}")
        return replies

    async def _pipeline(self, sha: str, cmds: list[tuple[list[str], list[Any]]]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for keys, args in cmds:
            pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies


def _reply(r: Any) -> Reply:
    v = list(r)
    expired = tuple(
        (v[i].decode() if isinstance(v[i], bytes) else str(v[i]), int(v[i + 1]))
        for i in range(6, len(v) - 1, 2)
    )
    return Reply(int(v[0]), int(v[1]), int(v[2]), int(v[3]), bool(int(v[4])), expired)
