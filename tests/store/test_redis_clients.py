"""The Redis client owner against a private redis-server: each feature holds one client, a
client nobody holds is closed (after its grace, or at once when a new URL would pass the bound),
and the server sees its connections go. Credentials are rotated the way an operator does it:
a new ACL user per URL."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.services import Services
from gateway.store import redis_client
from gateway.store.redis_client import (
    REDIS,
    RedisClients,
    redact,
    redis_for,
    release_redis,
    store_address,
)
from tests.redis_support import RedisServer
from tests.support import until

pytestmark = pytest.mark.redis


class Holder:
    """A feature holding a client (the limiter, the fleet store, a registry watcher)."""


@pytest.fixture
def admin(redis_server: RedisServer) -> Iterator[Any]:
    """A client of the test's own (synchronous: `until` polls it from the loop)."""
    from redis import Redis

    client = Redis.from_url(redis_server.url, decode_responses=True, socket_timeout=5)
    try:
        yield client
    finally:
        for user in client.acl_users():
            if user.startswith("rot-"):
                client.acl_deluser(user)
        client.close()


def rotated(admin: Any, server: RedisServer, n: int) -> str:
    """The URL of credential `n` (an ACL user of its own)."""
    admin.acl_setuser(
        f"rot-{n}", enabled=True, passwords=[f"+pw-{n}"], keys=["*"], commands=["+@all"]
    )
    return f"redis://rot-{n}:pw-{n}@127.0.0.1:{server.port}/0"


def users_connected(admin: Any) -> set[str]:
    return {c["user"] for c in admin.client_list() if c["user"].startswith("rot-")}


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://alice:s3cr%40t@h.example:6380/2", "redis://alice:***@h.example:6380/2"),
        ("redis://:pw@10.0.0.5:6379/0", "redis://:***@10.0.0.5:6379/0"),
        ("rediss://TOKEN@h.example/0?ssl_cert_reqs=none", "rediss://***@h.example/0"),
        ("redis://bob:pw@[::1]:6379/0", "redis://bob:***@[::1]:6379/0"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("unix:///run/redis.sock", "unix:///run/redis.sock"),
        ("redis://u:p@ss@h:6379/0", "redis://u:***@h:6379/0"),  # an @ left unencoded
        ("redis://u:pw@h:notaport/0", "redis://u:***@h:notaport/0"),  # shown, not parsed
        ("redis://h:99999/0", "redis://h:99999/0"),
        ("redis://u:pw@[::1:6379/0", "redis://(unreadable URL)"),
        ("u:pw@h:6379/0", "(unreadable URL)"),  # no scheme: nothing of it is shown
        ("re dis://u:pw@h/0", "(unreadable URL)"),
    ],
)
def test_urls_are_shown_with_their_users_never_their_secrets(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_a_rotated_credential_names_the_same_store() -> None:
    one = store_address("redis://rot-1:pw-1@h.example:6379/0")
    assert one == store_address("redis://rot-2:pw-2@h.example:6379/0") == "redis://h.example:6379/0"
    assert one != store_address("redis://rot-1:pw-1@h.example:6379/1")  # another database
    assert one != store_address("redis://rot-1:pw-1@other.example:6379/0")
    assert store_address("redis://u:pw@[::1:6379/0") == "redis://u:pw@[::1:6379/0"  # unreadable


async def test_a_client_nobody_holds_is_closed_after_its_grace(
    admin: Any, redis_server: RedisServer
) -> None:
    clients = RedisClients(retire_after_s=0.3)
    a, b = Holder(), Holder()
    try:
        url0, url1 = rotated(admin, redis_server, 0), rotated(admin, redis_server, 1)
        c0 = clients.get(url0, holder=a)
        assert clients.get(url0, holder=b) is c0  # one client per URL
        assert await c0.ping()
        assert users_connected(admin) == {"rot-0"}
        c1 = clients.get(url1, holder=a)  # a moves on; b still holds url0
        assert await c1.ping()
        clients.release(b)  # nobody holds url0 now
        # Shown with their users, never their passwords: the two rotations tell apart.
        shown = f"rot-{{}}:***@127.0.0.1:{redis_server.port}/0"
        assert clients.readiness()["clients"] == [
            f"redis://{shown.format(0)} (unused)",
            f"redis://{shown.format(1)}",
        ]
        assert "pw-" not in repr(clients.readiness())
        assert await c0.ping()  # a call still in flight when its holder moved on completes
        await until(lambda: users_connected(admin), 5, ok=lambda u: u == {"rot-1"})
        assert clients.readiness() == {"clients": [f"redis://{shown.format(1)}"], "retired": 1}
        assert clients.get(url1, holder=b) is c1
    finally:
        await clients.aclose()
    await until(lambda: users_connected(admin), 3, ok=lambda u: u == set())


async def test_held_again_within_its_grace_the_client_stays(
    admin: Any, redis_server: RedisServer
) -> None:
    clients = RedisClients(retire_after_s=0.2)
    a = Holder()
    try:
        url0, url1 = rotated(admin, redis_server, 0), rotated(admin, redis_server, 1)
        c0 = clients.get(url0, holder=a)
        await c0.ping()
        clients.get(url1, holder=a)
        assert clients.get(url0, holder=a) is c0  # back (a rollback) before the grace ends
        await until(lambda: clients.readiness()["retired"], 3, ok=lambda n: n == 1)  # url1's
        assert clients.get(url0) is c0 and await c0.ping()
        assert users_connected(admin) == {"rot-0"}
    finally:
        await clients.aclose()


async def test_daily_rotations_past_the_bound_keep_one_client(
    admin: Any, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More rotations than `MAX_CLIENTS` within one grace: the unheld clients close at once
    instead of the next URL being refused."""
    monkeypatch.setattr(redis_client, "MAX_CLIENTS", 8)
    clients = RedisClients()  # the default grace: far longer than the test
    limiter, fleet = Holder(), Holder()
    try:
        for n in range(20):
            url = rotated(admin, redis_server, n)
            assert await clients.get(url, holder=limiter).ping()
            assert clients.get(url, holder=fleet) is clients.get(url)
            assert len(clients.readiness()["clients"]) <= 8
        assert clients.readiness()["retired"] >= 12
        # What is still connected: the clients of the last rotations, not the older ones.
        await until(lambda: users_connected(admin), 5, ok=lambda u: "rot-0" not in u)
        assert "rot-19" in users_connected(admin)
        assert len(users_connected(admin)) <= 8
    finally:
        await clients.aclose()


async def test_every_client_held_the_bound_refuses_a_new_url(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_client, "MAX_CLIENTS", 3)
    clients = RedisClients()
    holders = [Holder() for _ in range(3)]
    try:
        for db, h in enumerate(holders):
            clients.get(f"redis://127.0.0.1:{redis_server.port}/{db}", holder=h)
        with pytest.raises(ValueError, match="more than 3 Redis URLs in use"):
            clients.get(f"redis://127.0.0.1:{redis_server.port}/3", holder=Holder())
        del holders[0]  # a holder dropped without its release holds nothing
        gc.collect()
        clients.get(f"redis://127.0.0.1:{redis_server.port}/3", holder=Holder())
        assert clients.retired == 1
    finally:
        await clients.aclose()


async def test_release_through_the_services(admin: Any, redis_server: RedisServer) -> None:
    services = Services()
    holder = Holder()
    release_redis(services, holder)  # no owner yet: nothing to release
    assert services.peek(REDIS) is None
    url = rotated(admin, redis_server, 7)
    try:
        assert await redis_for(services, url, holder=holder).ping()
        owner = services.peek(REDIS)
        assert owner is not None
        owner.retire_after_s = 0.1
        release_redis(services, holder)
        await until(lambda: users_connected(admin), 3, ok=lambda u: u == set())
        assert owner.readiness()["retired"] == 1
    finally:
        await services.aclose()
