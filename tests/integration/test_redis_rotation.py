"""Redis credentials rotated by policy reloads, more times than the gateway keeps clients: two
gateway processes share a private redis-server, each rotation is a new ACL user in the store's
URL, and after every one both share their limits through it again. The clients of the old
credentials are closed (Redis sees their connections go) and no password reaches a log. Then a
replica is killed (SIGKILL) and Redis restarted mid-run, and the survivor rotates once more.
A reload that moves a replica to another Redis, by contrast, leaves the old replica set."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.store.redis_client import MAX_CLIENTS
from tests.integration.conftest import Backend, Gateway, start_gateway
from tests.integration.fleet_support import kill
from tests.integration.test_ratelimit_shared import admin_json, tail, wait_mode
from tests.redis_support import RedisServer
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.redis]

ROTATIONS = MAX_CLIENTS + 6


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[Any]:
    from redis import Redis

    server = RedisServer(tmp_path / "redis").start()
    client = Redis.from_url(server.url, decode_responses=True, socket_timeout=5)
    try:
        yield server, client
    finally:
        client.close()
        server.stop()


def credential(admin: Any, server: RedisServer, n: int) -> str:
    admin.acl_setuser(
        f"sluice-{n}", enabled=True, passwords=[f"+secret-{n}"], keys=["*"], commands=["+@all"]
    )
    return f"redis://sluice-{n}:secret-{n}@127.0.0.1:{server.port}/0"


def reload(gw: Gateway, url: str) -> None:
    gw.policy.write_text(gw.policy.read_text().split("rate_limits:")[0] + tail(url))
    req = urllib.request.Request(f"{gw.admin}/admin/policy/reload", method="POST", data=b"")
    with urllib.request.urlopen(req, timeout=10) as r:
        last = json.loads(r.read())["last_reload"]
    assert last["ok"], last


def users_connected(admin: Any) -> set[str]:
    return {c["user"] for c in admin.client_list() if c["user"].startswith("sluice-")}


def test_rotating_credentials_past_the_client_bound(
    backend: Backend, tmp_path: Path, redis: tuple[RedisServer, Any]
) -> None:
    server, admin = redis
    url = credential(admin, server, 0)
    gws: list[Gateway] = []
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            gws.append(start_gateway(backend, tmp_path / name, tail=tail(url)))
        wait_mode(gws, "redis", replicas=2)
        for n in range(1, ROTATIONS + 1):
            url = credential(admin, server, n)
            for g in gws:
                reload(g, url)
            # Both talk to Redis with the new credential before the next rotation.
            wait_mode(gws, "redis", replicas=2)
        connected = users_connected(admin)
        assert f"sluice-{ROTATIONS}" in connected
        # The bound was reached once: the clients nobody held then were closed at once, so
        # what is still connected is the last few credentials' (their grace has not ended).
        assert "sluice-0" not in connected and len(connected) <= ROTATIONS - MAX_CLIENTS + 2
        for g in gws:
            clients = admin_json(g, "/readyz")["redis"]
            assert clients["retired"] >= MAX_CLIENTS - 1, clients
            assert len(clients["clients"]) <= ROTATIONS - MAX_CLIENTS + 2, clients
            assert f"127.0.0.1:{server.port}/0" in clients["clients"][0]
            assert "secret" not in json.dumps(clients)
        # The old credentials revoked: the limits stay shared through the new one.
        for n in range(ROTATIONS):
            admin.acl_deluser(f"sluice-{n}")
        wait_until(lambda: users_connected(admin), 5, ok=lambda u: u == {f"sluice-{ROTATIONS}"})
        wait_mode(gws, "redis", replicas=2)
        # A replica crashes and Redis restarts (its users come back: an operator's ACL file;
        # here, written again), then one more rotation: the survivor follows each.
        kill(gws[1])
        wait_mode(gws[:1], "redis", replicas=1)
        server.stop()
        server.start()
        admin.connection_pool.disconnect()
        credential(admin, server, ROTATIONS)
        wait_mode(gws[:1], "redis", replicas=1)
        reload(gws[0], credential(admin, server, ROTATIONS + 1))
        wait_mode(gws[:1], "redis", replicas=1)
        connected = users_connected(admin)
        assert f"sluice-{ROTATIONS + 1}" in connected and len(connected) <= 2, connected
        # One client held; the last credential's (and those of the last rotations above, if
        # their 30 s have not passed) waiting to close.
        # Each shown with its user (which credential is which), never its password.
        at = f":***@127.0.0.1:{server.port}/0"
        clients = admin_json(gws[0], "/readyz")["redis"]["clients"]
        held = f"redis://sluice-{ROTATIONS + 1}{at}"
        assert held in clients and len(clients) >= 2, clients
        unused = re.compile(rf"redis://sluice-\d+{re.escape(at)} \(unused\)")
        assert all(unused.fullmatch(c) for c in clients if c != held), clients
    finally:
        codes = [g.proc.stop() for g in gws]
    assert codes[0] == 0, gws[0].proc.output()
    for g in gws:
        assert "secret-" not in g.proc.output()


def test_a_replica_moved_to_another_redis_leaves_the_old_replica_set(
    backend: Backend, tmp_path: Path, redis: tuple[RedisServer, Any]
) -> None:
    """Two gateway processes on one Redis; a reload moves one to another Redis. The one left
    behind counts itself alone within a few seconds (its next announces), not after the
    replica TTL (a minute here): the mover left the old replica set as it switched."""
    server, admin = redis
    other = RedisServer(tmp_path / "other").start()

    def store(url: str) -> str:
        return tail(url).replace("replica_ttl_s: 3", "replica_ttl_s: 60")

    gws: list[Gateway] = []
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            gws.append(start_gateway(backend, tmp_path / name, tail=store(server.url)))
        wait_mode(gws, "redis", replicas=2)
        a, b = gws
        b.policy.write_text(b.policy.read_text().split("rate_limits:")[0] + store(other.url))
        req = urllib.request.Request(f"{b.admin}/admin/policy/reload", method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["last_reload"]["ok"]
        wait_mode([a], "redis", replicas=1, timeout=10)  # the TTL would take 60 s
        wait_mode([b], "redis", replicas=1)
        assert admin.zrange("sluice:replicas:{sluice}", 0, -1) == [
            admin_json(a, "/admin/state")["fleet"]["replica"]
        ]
    finally:
        codes = [g.proc.stop() for g in gws]
        other.stop()
    assert codes == [0, 0], [g.proc.output() for g in gws]
