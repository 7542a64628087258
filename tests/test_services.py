"""The services: typed keys (one owner per key name), bounded close, nothing spawned after it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

import pytest

from gateway.services import ServiceKey, Services
from gateway.store.redis_client import REDIS, RedisClients


class Buckets:
    def __init__(self) -> None:
        self.closed = 0

    async def aclose(self) -> None:
        self.closed += 1


class Breakers:
    pass


BUCKETS: Final = ServiceKey[Buckets]("buckets")


def test_a_key_finds_the_one_owner_it_created() -> None:
    services = Services()
    assert services.peek(BUCKETS) is None
    owner = services.get(BUCKETS, Buckets)
    assert services.get(BUCKETS, Buckets) is owner
    assert services.peek(BUCKETS) is owner
    assert BUCKETS.owner is Buckets and BUCKETS.name == "buckets"


def test_two_owner_types_under_one_key_name_fail() -> None:
    services = Services()
    services.get(BUCKETS, Buckets)
    other = ServiceKey[Breakers]("buckets")  # another feature's key, same name
    with pytest.raises(TypeError, match="already held"):
        services.get(other, Breakers)
    with pytest.raises(TypeError, match="already held"):
        services.peek(other)
    assert isinstance(services.peek(BUCKETS), Buckets)  # the first owner is untouched


def test_the_redis_key_name_is_taken_by_one_owner_only() -> None:
    # What two features once did: each registered its own client owner under "redis".
    services = Services()
    services.get(REDIS, RedisClients)

    class OtherClients:
        pass

    with pytest.raises(TypeError):
        services.get(ServiceKey[OtherClients]("redis"), OtherClients)


def test_a_factory_that_builds_another_type_fails() -> None:
    services = Services()
    wrong: object = Breakers()
    with pytest.raises(TypeError, match="built a Breakers"):
        services.get(BUCKETS, lambda: wrong)  # type: ignore[arg-type, return-value]
    assert services.peek(BUCKETS) is None


async def test_close_is_bounded_and_nothing_starts_after_it() -> None:
    services = Services()
    owner = services.get(BUCKETS, Buckets)
    stubborn_runs = 0

    async def stubborn() -> None:
        # Swallows its first cancellation (as a client library that races its own timeout
        # can); the services cancel again and it ends.
        nonlocal stubborn_runs
        stubborn_runs += 1
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(3600)

    task = services.spawn(stubborn(), "stubborn")
    await asyncio.sleep(0)
    async with asyncio.timeout(5):
        await services.aclose()
    assert task.done() and stubborn_runs == 1
    assert owner.closed == 1 and services.tasks == 0

    started = False

    async def late() -> None:
        nonlocal started
        started = True

    late_task = services.spawn(late(), "late")
    await asyncio.sleep(0.01)
    assert late_task.cancelled() and not started and services.tasks == 0
    await services.aclose()  # a second close closes nothing twice
    assert owner.closed == 1


class Client:
    """A shared client (what the Redis owner is): other owners talk through it as they close."""

    def __init__(self) -> None:
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True


class Leaver:
    """An owner created before the client it uses (as the limiter is, asking for Redis late)."""

    def __init__(self, client: Callable[[], Client]) -> None:
        self.client = client
        self.saw_open: bool | None = None

    async def aclose(self) -> None:
        self.saw_open = not self.client().closed


CLIENT: Final = ServiceKey[Client]("client", closes_last=True)
LEAVER: Final = ServiceKey[Leaver]("leaver")


async def test_a_shared_client_closes_after_the_owners_that_use_it() -> None:
    services = Services()
    leaver = services.get(LEAVER, lambda: Leaver(lambda: services.get(CLIENT, Client)))
    client = services.get(CLIENT, Client)  # created after its user: newest, yet closed last
    owner = services.get(BUCKETS, Buckets)
    await services.aclose()
    assert leaver.saw_open is True and client.closed and owner.closed == 1
