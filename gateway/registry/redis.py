"""The shared Redis client owner in the services (key "redis"): one asyncio client per URL,
opened on first use, closed once at stop.

Every caller bounds its own calls with a deadline (`asyncio.timeout`); the client's socket
timeouts are a second, coarser bound. URLs may carry a password: they are never logged or shown
(`readiness()` lists hosts only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from gateway.services import Services

SOCKET_TIMEOUT_S = 2.0
MAX_CLIENTS = 64  # distinct URLs; the policy names them, so this is a bound, not a limit in use


def redact(url: str) -> str:
    """`redis://user:secret@host:6379/0` → `redis://host:6379/0`."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


class RedisClients:
    """One `redis.asyncio.Redis` per URL (each with its own small connection pool)."""

    def __init__(self) -> None:
        self._clients: dict[str, Redis] = {}

    def get(self, url: str) -> Redis:
        client = self._clients.get(url)
        if client is None:
            if len(self._clients) >= MAX_CLIENTS:
                raise ValueError(f"more than {MAX_CLIENTS} Redis URLs in use")
            from redis.asyncio import Redis

            client = Redis.from_url(
                url,
                socket_timeout=SOCKET_TIMEOUT_S,
                socket_connect_timeout=SOCKET_TIMEOUT_S,
                max_connections=16,
                retry_on_timeout=False,
            )
            self._clients[url] = client
        return client

    def readiness(self) -> dict[str, Any]:
        return {"clients": sorted(redact(u) for u in self._clients)}

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            await c.aclose()


def redis_client(services: Services, url: str) -> Redis:
    """The services' client for `url` (created on first use, shared by every feature)."""
    return services.get("redis", RedisClients).get(url)
