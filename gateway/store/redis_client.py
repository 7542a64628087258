"""The gateway's one Redis client owner (services key `REDIS`), shared by every feature: the
limiter's store, backend heartbeat discovery, anything later.

`redis_for(services, url, cluster=...)` returns the client for `(url, cluster)`, created on first
use; the next policy's filters and every other feature asking for the same URL get the same one.
At most `MAX_CLIENTS` distinct clients (the policy names the URLs, so this is a bound, not a
limit in use). Clients connect lazily and never retry inside a call: each caller puts its own hard
deadline around what it awaits (the limiter: `deadline_ms`, the registry: `timeout_s`) and decides
what a failure means; the socket timeouts are only the outer bound. URLs may carry a password:
they are never logged or shown (`readiness()` lists them redacted). Closed once, at stop, by
`Services.aclose`, after every other owner (its key `closes_last`): the limiter, budgets and fleet
owners still talk to Redis as they close.
"""

from __future__ import annotations

from typing import Any, Final
from urllib.parse import urlsplit

from gateway.services import ServiceKey, Services

OUTER_TIMEOUT_S = 2.0
MAX_CLIENTS = 64


def redact(url: str) -> str:
    """`redis://user:secret@host:6379/0` → `redis://host:6379/0`."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


class RedisClients:
    """Owner of every Redis client: one `redis.asyncio.Redis` (or `RedisCluster`) per
    (URL, cluster), each with its own connection pool."""

    def __init__(self) -> None:
        self._clients: dict[tuple[str, bool], Any] = {}
        self.closed = False

    def get(self, url: str, *, cluster: bool = False) -> Any:
        key = (url, cluster)
        client = self._clients.get(key)
        if client is None:
            if self.closed:
                raise RuntimeError("the Redis clients are closed (the gateway is stopping)")
            if len(self._clients) >= MAX_CLIENTS:
                raise ValueError(f"more than {MAX_CLIENTS} Redis URLs in use")
            client = self._clients[key] = _create(url, cluster)
        return client

    def readiness(self) -> dict[str, Any]:
        return {
            "clients": sorted(redact(u) + (" (cluster)" if c else "") for u, c in self._clients)
        }

    async def aclose(self) -> None:
        self.closed = True
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            await c.aclose()


REDIS: Final = ServiceKey[RedisClients]("redis", closes_last=True)  # the others talk through it


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


def redis_for(services: Services, url: str, *, cluster: bool = False) -> Any:
    """The shared `redis.asyncio` client (or `RedisCluster`) for `url`."""
    return services.get(REDIS, RedisClients).get(url, cluster=cluster)
