"""The gateway's one Redis client owner (services key `REDIS`), shared by every feature: the
limiter's store, the fleet store, backend heartbeat discovery, anything later.

`redis_for(services, url, cluster=..., holder=...)` returns the client for `(url, cluster)`,
created on first use; every feature asking for the same URL gets the same one. Each feature
holds one client at a time: asking for another URL moves its hold, and `release_redis` drops
it (the feature's store removed from the policy, its watcher stopped). A client nobody holds
is closed `RETIRE_AFTER_S` later (the calls its last holder still had in flight end first: each
is bounded by its own deadline, ten seconds at most), or at once when a new URL would pass
`MAX_CLIENTS`. So a policy that rotates its Redis credentials every day keeps one client and
one pool of connections, not one per password it ever used; a holder dropped without its
release is closed the same way once the bound is reached.

Clients connect lazily and never retry inside a call: each caller puts its own hard deadline
around what it awaits (the limiter: `deadline_ms`, the registry: `timeout_s`) and decides what a
failure means; the socket timeouts are only the outer bound. URLs may carry a password: they
are never logged or shown (`readiness()` lists them redacted). Closed once, at stop, by
`Services.aclose`, after every other owner (its key `closes_last`): the limiter, budgets and
fleet owners still talk to Redis as they close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from typing import Any, Final
from urllib.parse import urlsplit

from gateway.services import ServiceKey, Services

log = logging.getLogger("sluice.redis")

OUTER_TIMEOUT_S = 2.0
MAX_CLIENTS = 64
# Longer than any call a holder may still have in flight when it moves on: a background call's
# deadline is at most 10 s (`sync_interval_ms` ≤ 10000), and so is a registry poll's `timeout_s`.
RETIRE_AFTER_S = 30.0

Key = tuple[str, bool]


def _split(url: str) -> tuple[str, str | None, str]:
    """(scheme, the credentials or None when there are none, host:port and path as written);
    ValueError when it is no readable URL (the policy's pattern lets none through)."""
    scheme, sep, _ = url.partition("://")
    if not sep or not scheme.isalnum():
        raise ValueError("no URL")
    parts = urlsplit(url)  # ValueError too: e.g. an unclosed IPv6 bracket
    userinfo, at, hostport = parts.netloc.rpartition("@")
    return parts.scheme, userinfo if at else None, hostport + parts.path


def redact(url: str) -> str:
    """The URL as it may be shown: `redis://alice:secret@host:6379/0` →
    `redis://alice:***@host:6379/0`. The password never shows, nor the query (it may carry
    one). The ACL user name does, so that two clients for different users (a credential
    rotated to a new user) can be told apart; a user name without a password is masked too
    (`redis://TOKEN@host` puts the secret there). Host and port are shown as written, never
    parsed: this never raises, whatever the URL."""
    try:
        scheme, userinfo, rest = _split(url)
    except ValueError:  # nothing of it is shown
        scheme, sep, _ = url.partition("://")
        return f"{scheme}://(unreadable URL)" if sep and scheme.isalnum() else "(unreadable URL)"
    who = ""
    if userinfo is not None:
        user, colon, _ = userinfo.partition(":")
        who = f"{user}:***@" if colon else "***@"
    return f"{scheme}://{who}{rest}"


def store_address(url: str) -> str:
    """Where a URL points, its credentials left out: two URLs that differ only in them (a
    rotated credential) name the same store. An unreadable URL is its own address (this is
    for comparing, never for showing: `redact` is)."""
    try:
        scheme, _, rest = _split(url)
    except ValueError:
        return url
    return f"{scheme}://{rest}"


class RedisClients:
    """Owner of every Redis client: one `redis.asyncio.Redis` (or `RedisCluster`) per
    (URL, cluster), each with its own connection pool, kept while a feature holds it."""

    def __init__(self, retire_after_s: float = RETIRE_AFTER_S) -> None:
        self.retire_after_s = retire_after_s
        self._clients: dict[Key, Any] = {}
        # holder -> the key it holds (weak: a holder gone without release holds nothing)
        self._holds: weakref.WeakKeyDictionary[object, Key] = weakref.WeakKeyDictionary()
        self._timers: dict[Key, asyncio.TimerHandle] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self.retired = 0
        self.closed = False

    def get(self, url: str, *, cluster: bool = False, holder: object | None = None) -> Any:
        """The client for `(url, cluster)`; `holder` moves its hold to it."""
        key = (url, cluster)
        client = self._clients.get(key)
        if client is None:
            if self.closed:
                raise RuntimeError("the Redis clients are closed (the gateway is stopping)")
            if len(self._clients) >= MAX_CLIENTS:
                for k in self._unheld():
                    self._retire(k)
                if len(self._clients) >= MAX_CLIENTS:
                    raise ValueError(f"more than {MAX_CLIENTS} Redis URLs in use")
            client = self._clients[key] = _create(url, cluster)
        if holder is not None:
            old = self._holds.get(holder)
            if old != key:
                self._holds[holder] = key
                timer = self._timers.pop(key, None)
                if timer is not None:
                    timer.cancel()
                if old is not None:
                    self._unhold(old)
        return client

    def release(self, holder: object) -> None:
        """`holder` no longer uses its client."""
        old = self._holds.pop(holder, None)
        if old is not None:
            self._unhold(old)

    def _unheld(self) -> list[Key]:
        held = set(self._holds.values())
        return [k for k in self._clients if k not in held]

    def _unhold(self, key: Key) -> None:
        if key in self._timers or key not in self._clients or key in self._holds.values():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a policy compiled offline): nothing ever connected
            self._clients.pop(key, None)
            return
        # (a holder taking the key again cancels the timer: when it fires, nobody holds it)
        self._timers[key] = loop.call_later(self.retire_after_s, self._retire, key)

    def _retire(self, key: Key) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        client = self._clients.pop(key, None)
        if client is None:
            return
        self.retired += 1
        log.info("redis: closing the unused client for %s", redact(key[0]))
        try:
            task = asyncio.get_running_loop().create_task(_close(client), name="sluice-redis-close")
        except RuntimeError:
            return
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def readiness(self) -> dict[str, Any]:
        def shown(key: Key) -> str:
            url, cluster = key
            cl, unused = " (cluster)" if cluster else "", " (unused)" if key in self._timers else ""
            return redact(url) + cl + unused

        return {"clients": sorted(map(shown, self._clients)), "retired": self.retired}

    async def aclose(self) -> None:
        self.closed = True
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            await _close(c)
        if self._closing:
            await asyncio.wait(set(self._closing))


REDIS: Final = ServiceKey[RedisClients]("redis", closes_last=True)  # the others talk through it


async def _close(client: Any) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(OUTER_TIMEOUT_S):
            await client.aclose()


def _create(url: str, cluster: bool) -> Any:
    from redis.asyncio.retry import Retry  # the asyncio one: redis-py 8 warns of the other
    from redis.backoff import NoBackoff

    common: dict[str, Any] = {
        "socket_timeout": OUTER_TIMEOUT_S,
        "socket_connect_timeout": OUTER_TIMEOUT_S,
        "health_check_interval": 0,
        "retry": Retry(NoBackoff(), 0),
    }
    if cluster:
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(url, **common)
    from redis.asyncio import Redis

    return Redis.from_url(url, **common)


def redis_for(services: Services, url: str, *, cluster: bool = False, holder: object) -> Any:
    """The shared `redis.asyncio` client (or `RedisCluster`) for `url`, held by `holder` (one
    client per holder: a new URL moves the hold) until `release_redis`."""
    return services.get(REDIS, RedisClients).get(url, cluster=cluster, holder=holder)


def release_redis(services: Services, holder: object) -> None:
    """`holder` no longer uses Redis: its client closes once nobody else holds it."""
    owner = services.peek(REDIS)
    if owner is not None:
        owner.release(holder)
