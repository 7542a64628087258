"""The limit store's narrow protocol and the values that cross it.

A store holds the *global* state of limit keys (a sliding-window request counter and a token
bucket per key) and answers two questions, always for many keys in one round trip:

- `sync(ops)`: apply what a replica reports (admissions outside a lease, shares given back,
  tokens refunded or charged, arrivals) and lease it new shares; one op per active key, one
  pipelined round trip for all of them;
- `take(op)`: one request, all or nothing (`strict` rules).

plus `announce` (replicas count each other, for the fallback sizing). `MemoryStore` is the
in-process twin of `RedisStore`'s Lua; one contract suite runs against both.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

EPOCH_S = 3600.0  # a Redis hash lives two epochs; see lua/bucket.lua


@dataclass(frozen=True, slots=True)
class KeyParams:
    """A rule's numbers as the store needs them; their digest is part of every key name."""

    limit: float  # requests per window (0 = none)
    window_s: float
    rate: float  # tokens per second (0 = none)
    burst: float
    wq: float = 0.6
    wt: float = 0.4
    admit_below: float = 0.95

    @property
    def digest(self) -> str:
        text = f"{self.limit!r}/{self.window_s!r}/{self.rate!r}/{self.burst!r}/{EPOCH_S!r}"
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    def args(self) -> list[float]:
        return [self.limit, self.window_s, self.rate, self.burst]


def key_name(prefix: str, rule: str, params: KeyParams, key: str) -> str:
    """`PREFIX:rl:{RULE:PARAMS:KEY}`: the braces are the Cluster hash tag (both epochs of a
    key land on one slot); the key value is hashed so that names stay short and carry no
    client-controlled text."""
    h = hashlib.sha256(key.encode()).hexdigest()[:20]
    return f"{prefix}:rl:{{{rule}:{params.digest}:{h}}}"


@dataclass(slots=True)
class SyncOp:
    key: str  # from key_name(); the store adds the epoch
    params: KeyParams
    req_delta: float = 0.0
    tok_delta: float = 0.0
    offered: float = 0.0
    want_req: float = 0.0
    want_tok: float = 0.0
    reset: bool = False
    strict: bool = False


@dataclass(frozen=True, slots=True)
class SyncResult:
    granted_req: float
    granted_tok: float
    admitted: float  # global admitted estimate in the window (leases included)
    offered: float  # global offered estimate
    tokens: float  # global tokens available (after this op's grant)
    now: float  # the store's clock (Redis TIME), seconds


class LimitStore(Protocol):
    name: str  # "memory" | "redis"

    async def sync(self, ops: Sequence[SyncOp]) -> list[SyncResult]: ...

    async def take(self, op: SyncOp) -> SyncResult: ...

    async def announce(self, replica: str, ttl_s: float) -> int: ...

    async def leave(self, replica: str) -> None: ...

    async def ping(self) -> bool: ...

    async def connect(self, timeout_s: float) -> None: ...

    async def aclose(self) -> None: ...
