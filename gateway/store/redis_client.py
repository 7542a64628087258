"""The gateway's Redis clients: one per URL, owned by the services, shared by every feature.

`redis_for(services, url)` returns the client for `url` (created on first use; the next
policy's filters, and other features such as backend heartbeats, get the same one). Clients
connect lazily and never retry inside a call: each caller puts its own hard deadline around
what it awaits (the limiter: `deadline_ms`) and decides what a failure means. Connect and
socket timeouts are only the outer bound. Closed at stop by `Services.aclose`.
"""

from __future__ import annotations

from typing import Any

from gateway.services import Services

SERVICE_KEY = "redis"
OUTER_TIMEOUT_S = 2.0


class RedisClients:
    """Owner of every Redis client (services key "redis"): one per (URL, cluster)."""

    def __init__(self) -> None:
        self._clients: dict[tuple[str, bool], Any] = {}

    def get(self, url: str, *, cluster: bool = False) -> Any:
        key = (url, cluster)
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = _create(url, cluster)
        return client

    def readiness(self) -> dict[str, Any]:
        return {"clients": len(self._clients)}

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            await c.aclose()


def _create(url: str, cluster: bool) -> Any:
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    common: dict[str, Any] = {
        "socket_timeout": OUTER_TIMEOUT_S,
        "socket_connect_timeout": OUTER_TIMEOUT_S,
        "health_check_interval": 0,
    }
    if cluster:
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(url, retry=Retry(NoBackoff(), 0), **common)
    from redis.asyncio import Redis

    return Redis.from_url(url, retry=Retry(NoBackoff(), 0), **common)


def redis_for(services: Services, url: str, *, cluster: bool = False) -> Any:
    """The shared `redis.asyncio` client (or `RedisCluster`) for `url`."""
    return services.get(SERVICE_KEY, RedisClients).get(url, cluster=cluster)
