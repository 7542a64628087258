"""The Redis limit store: `lua/bucket.lua` per key, many keys in one pipelined round trip.

Scripts are sent as EVALSHA (loaded once, reloaded after a NOSCRIPT: a restarted or failed-over
Redis forgets them). Every call has a hard deadline (`deadline_s`); past it, or on any Redis
error, the call raises `StoreUnavailable` and the caller decides locally. Works on a single
Redis and on a Redis Cluster (`RedisCluster` client): both epochs of a key share one hash tag,
so each script touches one slot, and the cluster pipeline routes each command to its node.

Epochs are counted on Redis' clock (the offset to the local wall clock is learnt from each
answer), so every replica names the same hash at the same moment.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Sequence
from importlib.resources import files
from typing import Any

from gateway.errors import StoreUnavailable
from gateway.store.base import EPOCH_S, SyncOp, SyncResult

_LUA = files("gateway.store") / "lua"


class _Script:
    def __init__(self, name: str) -> None:
        self.source = (_LUA / name).read_text()
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()


BUCKET = _Script("bucket.lua")
ANNOUNCE = _Script("announce.lua")
LEAVE = _Script("leave.lua")


def _is_noscript(exc: BaseException) -> bool:
    return "NOSCRIPT" in str(exc) or type(exc).__name__ == "NoScriptError"


class RedisStore:
    name = "redis"

    def __init__(self, client: Any, *, prefix: str = "sluice", deadline_s: float = 0.02) -> None:
        self.client = client
        self.prefix = prefix
        self.deadline_s = deadline_s
        self.offset = 0.0  # Redis TIME - local wall clock, learnt from every answer
        self.calls = 0
        self.errors = 0

    # -- the protocol -------------------------------------------------------------------------
    async def sync(self, ops: Sequence[SyncOp]) -> list[SyncResult]:
        if not ops:
            return []
        epoch = math.floor((time.time() + self.offset) / EPOCH_S)
        cmds = [self._bucket_args(op, epoch) for op in ops]
        replies = await self._run(BUCKET, cmds)
        return [self._result(r) for r in replies]

    async def take(self, op: SyncOp) -> SyncResult:
        epoch = math.floor((time.time() + self.offset) / EPOCH_S)
        (reply,) = await self._run(BUCKET, [self._bucket_args(op, epoch)])
        return self._result(reply)

    async def announce(self, replica: str, ttl_s: float) -> int:
        (reply,) = await self._run(ANNOUNCE, [([self._replicas_key()], [replica, ttl_s])])
        self.offset = float(reply[1]) - time.time()
        return int(reply[0])

    async def leave(self, replica: str) -> None:
        await self._run(LEAVE, [([self._replicas_key()], [replica])])

    async def ping(self) -> bool:
        try:
            async with asyncio.timeout(self.deadline_s):
                return bool(await self.client.ping())
        except (TimeoutError, OSError, Exception):
            return False

    async def connect(self, timeout_s: float) -> None:
        """A (re)connect attempt with its own, longer budget: the background loop calls it, a
        request never does. Loads the scripts (on every node of a Cluster)."""
        try:
            async with asyncio.timeout(timeout_s):
                init = getattr(self.client, "initialize", None)
                if init is not None:
                    await init()
                for s in (BUCKET, ANNOUNCE, LEAVE):
                    await self.client.script_load(s.source)
        except Exception as exc:  # any failure means: not yet
            raise StoreUnavailable(f"redis connect: {type(exc).__name__}") from exc

    async def aclose(self) -> None:
        """The client belongs to the services' Redis owner, which closes it."""

    # -- internals ----------------------------------------------------------------------------
    def _replicas_key(self) -> str:
        return f"{self.prefix}:replicas:{{{self.prefix}}}"

    @staticmethod
    def _bucket_args(op: SyncOp, epoch: int) -> tuple[list[str], list[Any]]:
        p = op.params
        return (
            [f"{op.key}:{epoch}", f"{op.key}:{epoch - 1}"],
            [
                p.limit, p.window_s, p.rate, p.burst, int(2 * EPOCH_S),
                op.req_delta, op.tok_delta, op.offered, op.want_req, op.want_tok,
                "1" if op.reset else "0", "1" if op.strict else "0",
                p.wq, p.wt, p.admit_below,
            ],
        )  # fmt: skip

    def _result(self, r: Any) -> SyncResult:
        now = float(r[5])
        self.offset = now - time.time()
        return SyncResult(float(r[0]), float(r[1]), float(r[2]), float(r[3]), float(r[4]), now)

    async def _run(self, script: _Script, cmds: list[tuple[list[str], list[Any]]]) -> list[Any]:
        self.calls += 1
        try:
            async with asyncio.timeout(self.deadline_s):
                replies = await self._pipeline(script.sha, cmds)
                if any(isinstance(r, Exception) and _is_noscript(r) for r in replies):
                    await self.client.script_load(script.source)
                    replies = await self._pipeline(script.sha, cmds)
        except TimeoutError as exc:
            self.errors += 1
            raise StoreUnavailable("redis deadline exceeded") from exc
        except StoreUnavailable:
            self.errors += 1
            raise
        except Exception as exc:  # connection refused, reset, cluster down, ...
            self.errors += 1
            raise StoreUnavailable(f"redis: {type(exc).__name__}") from exc
        for r in replies:
            if isinstance(r, Exception):
                self.errors += 1
                raise StoreUnavailable(f"redis: {type(r).__name__}")
        return replies

    async def _pipeline(self, sha: str, cmds: list[tuple[list[str], list[Any]]]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for keys, args in cmds:
            pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies
