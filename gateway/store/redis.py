"""The Redis limit store: `lua/bucket.lua` per key, many keys in one pipelined round trip.

Scripts are sent as EVALSHA (loaded once, reloaded after a NOSCRIPT: a restarted or failed-over
Redis forgets them). A sync packs up to `BATCH` keys into one script call (on a Cluster: the keys
of one hash slot), with one compact argument per key: redis-py spends most of a call's CPU
encoding arguments, ~40 µs for a one-key call with twenty of them. Every call has a hard
deadline; past it, or on any Redis error, the call raises `StoreUnavailable` and the caller
decides locally. Works on a single
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
from gateway.store.base import EPOCH_S, KeyParams, SyncOp, SyncResult

_LUA = files("gateway.store") / "lua"
BATCH = 200  # ops per script call: a script runs alone, so keep each one short (~1-2 ms)


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

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = "sluice",
        deadline_s: float = 0.02,
        sync_deadline_s: float | None = None,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.deadline_s = deadline_s  # what a request may wait (strict `take`)
        # Background calls (sync, announce): no request waits for them, and a busy event loop
        # must not turn a Redis that did answer into a "Redis away".
        self.sync_deadline_s = sync_deadline_s if sync_deadline_s is not None else deadline_s
        self.offset = 0.0  # Redis TIME - local wall clock, learnt from every answer
        self.calls = 0
        self.errors = 0

    # -- the protocol -------------------------------------------------------------------------
    async def sync(self, ops: Sequence[SyncOp]) -> list[SyncResult]:
        if not ops:
            return []
        epoch = math.floor((time.time() + self.offset) / EPOCH_S)
        batches = self._batches(ops)
        cmds = [self._batch_args(b, epoch, ops) for b in batches]
        replies = await self._run(BUCKET, cmds, self.sync_deadline_s)
        out: list[SyncResult | None] = [None] * len(ops)
        for b, reply in zip(batches, replies, strict=True):
            for i, r in zip(b, self._results(reply), strict=True):
                out[i] = r
        return out  # type: ignore[return-value]  # every slot is filled

    async def take(self, op: SyncOp) -> SyncResult:
        epoch = math.floor((time.time() + self.offset) / EPOCH_S)
        (reply,) = await self._run(BUCKET, [self._batch_args([0], epoch, [op])], self.deadline_s)
        return self._results(reply)[0]

    async def announce(self, replica: str, ttl_s: float) -> int:
        args = [([self._replicas_key()], [replica, ttl_s])]
        (reply,) = await self._run(ANNOUNCE, args, self.sync_deadline_s)
        self.offset = float(reply[1]) - time.time()
        return int(reply[0])

    async def leave(self, replica: str) -> None:
        await self._run(LEAVE, [([self._replicas_key()], [replica])], self.sync_deadline_s)

    async def ping(self) -> bool:
        try:
            async with asyncio.timeout(self.deadline_s):
                return bool(await self.client.ping())
        except Exception:
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

    def _batches(self, ops: Sequence[SyncOp]) -> list[list[int]]:
        """Op indexes per script call: at most BATCH each, one hash slot each on a Cluster."""
        slot_of = getattr(self.client, "keyslot", None)
        if slot_of is None:
            idx = list(range(len(ops)))
            return [idx[i : i + BATCH] for i in range(0, len(idx), BATCH)]
        groups: dict[int, list[int]] = {}
        for i, op in enumerate(ops):
            groups.setdefault(slot_of(op.key), []).append(i)
        return [g[i : i + BATCH] for g in groups.values() for i in range(0, len(g), BATCH)]

    @staticmethod
    def _batch_args(
        batch: list[int], epoch: int, ops: Sequence[SyncOp]
    ) -> tuple[list[str], list[Any]]:
        keys: list[str] = []
        sets: dict[KeyParams, int] = {}
        set_args: list[Any] = []
        op_args: list[str] = []
        ttl = int(2 * EPOCH_S)
        for i in batch:
            op = ops[i]
            p = op.params
            si = sets.get(p)
            if si is None:
                si = sets[p] = len(sets)
                set_args += [p.limit, p.window_s, p.rate, p.burst, ttl, p.wq, p.wt, p.admit_below]
            keys += (f"{op.key}:{epoch}", f"{op.key}:{epoch - 1}")
            op_args.append(
                f"{si},{op.req_delta!r},{op.tok_delta!r},{op.offered!r},{op.want_req!r},"
                f"{op.want_tok!r},{'1' if op.reset else '0'},{'1' if op.strict else '0'}"
            )
        return keys, [len(sets), *set_args, *op_args]

    def _results(self, reply: Any) -> list[SyncResult]:
        now = float(reply[1])
        self.offset = now - time.time()
        out = []
        for part in bytes(reply[0]).split(b";"):
            gr, gt, adm, off, tok = part.split(b",")
            out.append(SyncResult(float(gr), float(gt), float(adm), float(off), float(tok), now))
        return out

    async def _run(
        self, script: _Script, cmds: list[tuple[list[str], list[Any]]], deadline_s: float
    ) -> list[Any]:
        self.calls += 1
        try:
            async with asyncio.timeout(deadline_s):
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
