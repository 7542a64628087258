"""A 3-master Redis Cluster started from redis-server binaries: the store works unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.store.base import KeyParams, SyncOp, SyncResult, key_name
from gateway.store.redis import RedisStore
from gateway.store.redis_client import RedisClients
from tests.redis_support import RedisServer, start_cluster
from tests.store.windows import one_window

pytestmark = pytest.mark.redis
P = KeyParams(limit=50, window_s=1.0, rate=100, burst=1000)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisServer]]:
    nodes = start_cluster(Path(tmp_path_factory.mktemp("cluster")))
    try:
        yield nodes
    finally:
        for n in nodes:
            n.stop()


async def test_cluster_sync_take_and_announce(cluster: list[RedisServer]) -> None:
    clients = RedisClients()
    try:
        client = clients.get(cluster[0].url.removesuffix("/0"), cluster=True)
        store = RedisStore(client, prefix="c", deadline_s=2.0)
        await store.connect(10.0)
        keys: list[str] = []

        async def steps(suffix: str) -> list[SyncResult]:
            keys[:] = [key_name("c", "rule", P, f"tenant-{i}{suffix}") for i in range(300)]
            ops = [SyncOp(k, P, want_req=5, want_tok=10, offered=1) for k in keys]
            return await store.sync(ops) + await store.sync(
                [SyncOp(k, P, want_req=100) for k in keys[:10]]
            )

        both = await one_window(steps)
        res, again = both[:300], both[300:]
        assert all(r.granted_req == 5 and r.granted_tok == 10 for r in res)
        assert all(r.granted_req == 45 for r in again)  # the first 5 still count
        # Both epochs of a key share a hash tag; the keys spread over every master.
        slots = {await client.cluster_keyslot(k) for k in keys[:50]}
        owners = {client.get_node_from_key(k).name for k in keys}
        assert len(slots) > 10 and len(owners) == 3
        taken = [await store.take(SyncOp(keys[0], P, want_req=1, strict=True)) for _ in range(3)]
        assert sum(int(t.granted_req) for t in taken) == 0  # the window is full
        assert await store.announce("r1", 5) == 1
    finally:
        await clients.aclose()  # a leaked cluster client warns later, in another test
