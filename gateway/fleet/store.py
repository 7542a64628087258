"""The fleet store's one owner in the services (key `FLEET`): the shared Redis every feature
that must hold across replicas uses, its mode, the live replica count, reconnection.

    from gateway.fleet.store import Script, fleet_for
    fleet = fleet_for(services)            # the owner (created on first use)
    fleet.mode                             # "none" | "shared" | "fallback"
    fleet.replicas                         # live replicas, last known (>= 1)
    await fleet.run(SCRIPT, keys, args)    # one EVALSHA; raises StoreUnavailable
    await fleet.pipeline(SCRIPT, [(keys, args), ...])
    fleet.on_mode(callback)                # callback(mode) after every change
    fleet.key("slots", pool)               # "PREFIX:slots:{pool}" (a Cluster hash tag)

Modes: `none` when the policy names no store (each replica on its own); `shared` while the
store answers; `fallback` from the first failed call (or before the first connect) until a
background reconnect succeeds: a feature then decides on its last known share (typically its
limit ÷ `replicas`). Every call has a hard deadline (`deadline_s`, default the background one:
max(deadline_ms, sync_interval_ms)); a request never waits on a reconnect.

The owner announces this replica once a second (a sorted set of replica ids, scored by Redis
`TIME`; a replica silent for `replica_ttl_s` no longer counts), and leaves it at stop. A reload
that changes the URL, cluster flag or key prefix switches to the new store (fallback until it
connects) and leaves the old store's replica set, so that the replicas still there re-size at
once; other options apply at once. The client itself belongs to the services' Redis owner
(`gateway.store.redis_client`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Callable
from importlib.resources import files
from typing import Any, Final

from gateway.errors import StoreUnavailable
from gateway.policy.ratelimits import RedisStoreOptions
from gateway.services import ServiceKey, Services
from gateway.telemetry import metrics

log = logging.getLogger("sluice.fleet")

ANNOUNCE_S = 1.0
RETRY_MIN_S, RETRY_MAX_S = 0.25, 2.0
# After the store lost its state: how long replicas may still be reconnecting (the longest
# jittered backoff, and a hello). Slot grants stay capped at the fallback share meanwhile.
REBIRTH_S = 1.5 * RETRY_MAX_S + 1.0
MODES = ("none", "shared", "fallback")
_LUA = files("gateway.fleet") / "lua"


class Script:
    """A Lua script run by SHA (loaded at connect; reloaded after a NOSCRIPT)."""

    def __init__(self, source: str, name: str = "") -> None:
        self.name = name
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    @classmethod
    def file(cls, name: str) -> Script:
        """A script from `gateway/fleet/lua/`."""
        return cls((_LUA / name).read_text(), name)


ANNOUNCE = Script((files("gateway.store") / "lua" / "announce.lua").read_text(), "announce")
LEAVE = Script((files("gateway.store") / "lua" / "leave.lua").read_text(), "leave")


async def nap(wake: asyncio.Event, seconds: float) -> None:
    """Sleep until `wake` is set or `seconds` pass (a background loop's tick)."""
    try:  # (not wait_for: on 3.11 it can lose a cancellation that races its timeout)
        async with asyncio.timeout(seconds):
            await wake.wait()
    except TimeoutError:
        pass


def _is_noscript(exc: BaseException) -> bool:
    return "NOSCRIPT" in str(exc) or type(exc).__name__ == "NoScriptError"


class FleetStore:
    def __init__(self, services: Services) -> None:
        self.services = services
        self.now = services.clock.now
        self.cfg: RedisStoreOptions | None = None
        self.client: Any = None
        self.mode = "none"
        self.replicas = 1
        self.replica_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.last_error = ""
        self.born = 0.0  # when the store's fleet state began (Redis time, s): 0 = unknown
        self.offset = 0.0  # Redis time - local wall clock, learnt at every hello
        self._recount_until = 0.0
        self.since = self.now()  # when the mode last changed
        self.changes = 0
        self.calls = 0
        self.errors = 0
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self._observers: list[Callable[[str], None]] = []
        # Sections of features that share through the store, shown under /admin/state's
        # `fleet` (name -> a function returning rows): e.g. "pools" (the backend slots).
        self.views: dict[str, Callable[[], Any]] = {}
        self._set_gauges()

    # -- configuration ------------------------------------------------------------------------
    def configure(self, cfg: RedisStoreOptions | None) -> None:
        """The policy's store (`gateway.policy.store.effective_store`); idempotent."""
        old, self.cfg = self.cfg, cfg
        if cfg is None:
            from gateway.store.redis_client import release_redis

            self.client = None
            release_redis(self.services, self)
            self._set_mode("none")
            return
        same = old is not None and (old.url, old.cluster, old.key_prefix) == (
            cfg.url, cfg.cluster, cfg.key_prefix,
        )  # fmt: skip
        if not same or self.client is None:
            from gateway.store.redis_client import redis_for, store_address

            if (
                old is not None
                and self.client is not None
                and self.mode == "shared"
                and (store_address(old.url), old.cluster, old.key_prefix)
                != (store_address(cfg.url), cfg.cluster, cfg.key_prefix)
            ):  # another replica set (not a credential rotated on the same store)
                self._leave_previous(self.client, old.key_prefix)
            self.client = redis_for(self.services, cfg.url, cluster=cfg.cluster, holder=self)
            self._set_mode("fallback", "not connected yet")
            self.wake.set()
        if self.task is None or self.task.done():
            loop = self._loop()
            try:
                self.task = self.services.spawn(loop, "sluice-fleet-store")
            except RuntimeError:  # no running loop (a policy compiled offline): nothing to run
                loop.close()
                self.task = None

    @property
    def shared(self) -> bool:
        return self.mode == "shared"

    @property
    def prefix(self) -> str:
        return self.cfg.key_prefix if self.cfg is not None else "sluice"

    @property
    def deadline_s(self) -> float:
        """The deadline of a background call: max(deadline_ms, sync_interval_ms)."""
        cfg = self.cfg
        if cfg is None:
            return 0.05
        return max(cfg.deadline_ms, cfg.sync_interval_ms) / 1000

    @property
    def interval_s(self) -> float:
        """How often features sync with the store (`sync_interval_ms`)."""
        return self.cfg.sync_interval_ms / 1000 if self.cfg is not None else 0.05

    def key(self, kind: str, name: str) -> str:
        """`PREFIX:KIND:{NAME}`: NAME is the Cluster hash tag (one slot per name)."""
        return f"{self.prefix}:{kind}:{{{name}}}"

    def on_mode(self, callback: Callable[[str], None]) -> None:
        """Call `callback(mode)` after every mode change (from the event loop's thread)."""
        if callback not in self._observers:
            self._observers.append(callback)

    # -- calls --------------------------------------------------------------------------------
    async def run(
        self, script: Script, keys: list[str], args: list[Any], deadline_s: float | None = None
    ) -> Any:
        """One script call; `StoreUnavailable` (and fallback) when it fails or is late."""
        (reply,) = await self.pipeline(script, [(keys, args)], deadline_s)
        return reply

    async def pipeline(
        self,
        script: Script,
        cmds: list[tuple[list[str], list[Any]]],
        deadline_s: float | None = None,
        op: str = "",
    ) -> list[Any]:
        """Many calls of one script in one round trip (non-transactional)."""
        client = self.client
        if client is None or self.mode == "none":
            raise StoreUnavailable("no fleet store configured")
        self.calls += 1
        try:
            async with asyncio.timeout(deadline_s if deadline_s is not None else self.deadline_s):
                replies = await _pipeline(client, script.sha, cmds)
                if any(isinstance(r, Exception) and _is_noscript(r) for r in replies):
                    await client.script_load(script.source)
                    replies = await _pipeline(client, script.sha, cmds)
            bad = next((r for r in replies if isinstance(r, Exception)), None)
            if bad is not None:
                raise StoreUnavailable(f"redis: {type(bad).__name__}: {str(bad)[:120]}")
        except TimeoutError as exc:
            raise self._failed("redis deadline exceeded", op or script.name) from exc
        except StoreUnavailable as exc:
            raise self._failed(str(exc), op or script.name) from exc
        except Exception as exc:  # refused, reset, cluster down, ...
            raise self._failed(f"redis: {type(exc).__name__}", op or script.name) from exc
        return replies

    def _failed(self, reason: str, op: str) -> StoreUnavailable:
        self.errors += 1
        metrics.FLEET_STORE_ERRORS.labels(op or "call").inc()
        if self.mode == "shared":
            self._set_mode("fallback", reason)
            self.wake.set()
        self.last_error = reason
        return StoreUnavailable(reason)

    # -- the background loop ------------------------------------------------------------------
    async def _loop(self) -> None:
        backoff = RETRY_MIN_S
        while not self.services.closed:
            self.wake.clear()
            cfg = self.cfg
            wait = ANNOUNCE_S
            if cfg is not None:
                if self.mode == "fallback":
                    if await self._connect(cfg):
                        backoff = RETRY_MIN_S
                    else:
                        wait = backoff * (0.5 + random.random())
                        backoff = min(RETRY_MAX_S, backoff * 2)
                elif self.mode == "shared":
                    await self.announce()
            await nap(self.wake, wait)

    async def _connect(self, cfg: RedisStoreOptions) -> bool:
        client = self.client
        if client is None:
            return False
        try:
            async with asyncio.timeout(cfg.connect_timeout_ms / 1000):
                init = getattr(client, "initialize", None)
                if init is not None:
                    await init()
                for s in (ANNOUNCE, LEAVE):
                    await client.script_load(s.source)
                reply = await client.evalsha(
                    ANNOUNCE.sha, 2, *self._hello_keys(), self.replica_id, cfg.replica_ttl_s
                )
        except Exception as exc:  # any failure means: not yet
            self.last_error = f"redis connect: {type(exc).__name__}"
            metrics.FLEET_STORE_ERRORS.labels("connect").inc()
            return False
        if client is not self.client:  # reconfigured meanwhile
            return False
        self._hello(reply)
        self._set_mode("shared")
        return True

    async def announce(self) -> None:
        """Say this replica is alive; learn how many are."""
        cfg = self.cfg
        if cfg is None:
            return
        try:
            reply = await self.run(
                ANNOUNCE, self._hello_keys(), [self.replica_id, cfg.replica_ttl_s]
            )
        except StoreUnavailable:
            return
        self._hello(reply)

    def _hello(self, reply: Any) -> None:
        now = float(reply[1])
        self.offset = now - time.time()
        born = float(reply[2])
        n = int(reply[0])
        if self.born and born != self.born:
            # The store lost its state (restart, failover): its replica set fills again as the
            # others reconnect; until then the count from before is the better one.
            self._recount_until = born + REBIRTH_S
        if now < self._recount_until:
            n = max(n, self.replicas)
        self.born = born
        self._replicas(n)

    def store_time(self) -> float:
        """Now on the store's clock (Redis TIME, as last learnt), seconds."""
        return time.time() + self.offset

    def _hello_keys(self) -> list[str]:
        return [self._replicas_key(), f"{self.prefix}:fleet-born:{{{self.prefix}}}"]

    def _replicas_key(self) -> str:
        return _replicas_key(self.prefix)

    def _leave_previous(self, client: Any, prefix: str) -> None:
        """Leave the replica set of the store this replica moves away from (another URL,
        Cluster flag or key prefix), in the background and bounded by the deadline: the
        replicas still there count one less at their next announce instead of after
        `replica_ttl_s`. Best effort: the old client stays open for its grace meanwhile
        (`gateway.store.redis_client`), and a store that does not answer drops this replica
        by the TTL as before."""
        key, rid, deadline = _replicas_key(prefix), self.replica_id, self.deadline_s

        async def leave() -> None:
            try:
                async with asyncio.timeout(deadline):
                    await client.eval(LEAVE.source, 1, key, rid)
            except Exception as exc:  # down, late, retired: the TTL removes it there
                log.info(
                    "fleet store: could not leave the previous store's replica set (%s); it "
                    "stops counting this replica after replica_ttl_s",
                    type(exc).__name__,
                )

        coro = leave()
        try:
            self.services.spawn(coro, "sluice-fleet-leave")
        except RuntimeError:  # no running loop (a policy compiled offline): nothing to leave
            coro.close()

    def _replicas(self, n: int) -> None:
        n = max(1, n)
        changed = n != self.replicas
        self.replicas = n
        metrics.FLEET_REPLICAS.set(n)
        if changed:
            self._notify()

    def _set_mode(self, mode: str, reason: str = "") -> None:
        if mode == self.mode:
            return
        why = f" ({reason})" if reason else ""
        level = logging.WARNING if self.mode == "shared" else logging.INFO
        log.log(level, "fleet store: %s -> %s%s", self.mode, mode, why)
        if reason:
            self.last_error = reason
        self.mode = mode
        self.since = self.now()
        self.changes += 1
        self._set_gauges()
        self._notify()

    def _set_gauges(self) -> None:
        for m in MODES:
            metrics.FLEET_STORE_MODE.labels(m).set(1 if m == self.mode else 0)

    def _notify(self) -> None:
        for cb in list(self._observers):
            try:
                cb(self.mode)
            except Exception:
                log.exception("fleet store: a mode observer failed")

    # -- /readyz, /admin/state, stop ----------------------------------------------------------
    def readiness(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, "replicas": self.replicas}
        if self.mode == "fallback":
            out["store_error"] = self.last_error
        return out

    def state(self) -> dict[str, Any]:
        from gateway.store.redis_client import redact

        cfg = self.cfg
        if cfg is None:
            return {"mode": self.mode}  # no store: nothing is shared
        out: dict[str, Any] = {
            # fallback shows yellow on the status page (each replica decides on its share)
            "colour": "yellow" if self.mode == "fallback" else "green",
            "mode": self.mode,
            "store": redact(cfg.url),
            "replica": self.replica_id,
            "replicas": self.replicas,
            "mode_for_s": round(self.now() - self.since, 1),
            "mode_changes": self.changes,
            "calls": self.calls,
            "errors": self.errors,
            "last_error": self.last_error,
        }
        for name, view in self.views.items():
            out[name] = view()
        return out

    async def aclose(self) -> None:
        """Leave the replica set (the others re-size at once), bounded by the deadline."""
        if self.mode != "shared" or self.cfg is None:
            return
        try:
            await self.run(LEAVE, [self._replicas_key()], [self.replica_id])
        except StoreUnavailable as exc:
            log.info("fleet store: could not leave the replica set at stop: %s", exc)


def _replicas_key(prefix: str) -> str:
    # The key the rate limits' store has always announced to (one replica set per prefix).
    return f"{prefix}:replicas:{{{prefix}}}"


async def _pipeline(client: Any, sha: str, cmds: list[tuple[list[str], list[Any]]]) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    for keys, args in cmds:
        pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
    replies: list[Any] = await pipe.execute(raise_on_error=False)
    return replies


FLEET: Final = ServiceKey[FleetStore]("fleet")


def fleet_for(services: Services) -> FleetStore:
    """The fleet store's owner (created on first use; `configure`d by each policy)."""
    return services.get(FLEET, lambda: FleetStore(services))


def configure_fleet(policy: Any, services: Services) -> FleetStore:
    """Point the fleet store at what `policy` (a `Policy`) names; called when a policy goes
    live (and by each feature's activation, so that its store is current)."""
    from gateway.policy.store import effective_store

    fleet = fleet_for(services)
    fleet.configure(effective_store(getattr(policy, "store", None), policy.rate_limits))
    return fleet
