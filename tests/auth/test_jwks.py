"""gateway.auth.jwks against a real HTTP JWKS server: faults keep the last good set, fetches are
single-flight and rate-limited, a reload finds its source as it was."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.auth.jwks import JWKS, JwksCaches, JwksSource
from gateway.core import keyrefresh as kr
from gateway.policy.auth import JwksSource as JwksSpec
from gateway.services import Services
from tests.auth import mint
from tests.auth.jwks_server import JwksServer
from tests.support import until

K1, K2 = mint.rsa_key("k1"), mint.ec_key("k2")


@pytest.fixture
def server() -> Iterator[JwksServer]:
    s = JwksServer()
    s.serve(mint.jwks(K1))
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
async def services() -> AsyncIterator[Services]:
    s = Services()
    try:
        yield s
    finally:
        await s.aclose()


def spec(server: JwksServer, **over: Any) -> JwksSpec:
    base: dict[str, Any] = {"url": server.url, "cache_s": 30, "unknown_kid_cooldown_s": 0.2}
    return JwksSpec(**{"timeout_s": 1.0, **base, **over})


async def loaded(services: Services, sp: JwksSpec) -> tuple[JwksCaches, JwksSource]:
    owner = services.get(JWKS, lambda: JwksCaches(services))
    src = owner.source("corp", sp)
    owner.activate([(src, "corp", sp)])
    await until(lambda: src.current() is not None)
    return owner, src


async def refetch(src: JwksSource) -> None:
    """Make the source fetch now (as an unknown kid would), and wait for it."""
    await asyncio.sleep(src.params.cooldown)
    task = src.fetch_to_wait_for()
    assert task is not None
    await asyncio.wait_for(asyncio.shield(task), 10)


async def test_first_fetch_at_activation_and_readiness(
    server: JwksServer, services: Services
) -> None:
    owner, src = await loaded(services, spec(server))
    ks = src.current()
    assert ks is not None and "k1" in ks.by_kid
    r = services.readiness()["jwks"]["corp"]
    assert r["keys"] == 1 and r["usable"] is True and r["last_error"] is None
    assert r["age_s"] is not None and r["fetches"] == 1 and server.count() == 1


@pytest.mark.parametrize(
    ("fault", "kind"),
    [
        ({"status": 500, "body": b"oops"}, "http_error"),
        ({"status": 302, "body": b""}, "http_error"),  # redirects are not followed
        ({"ctype": "text/html", "body": b"<html>sign in</html>"}, "invalid"),
        ({"body": b"<html>sign in</html>"}, "invalid"),  # HTML labelled JSON
        ({"doc": {"keys": []}}, "invalid"),
        ({"doc": mint.jwks(mint.rsa_key("weak", bits=1024))}, "invalid"),
        ({"body": b'{"keys": [' + b" " * 300_000 + b"]}"}, "too_large"),
        ({"doc": mint.jwks(K1), "drip_s": 0.05}, "timeout"),
        ({"doc": mint.jwks(K1), "delay_s": 2.0}, "timeout"),
        ({"down": True}, "unreachable"),
    ],
)
async def test_a_bad_fetch_keeps_the_last_good_set(
    server: JwksServer, services: Services, fault: dict[str, Any], kind: str
) -> None:
    _, src = await loaded(services, spec(server))
    good = src.current()
    gen = src.generation
    if fault.pop("down", False):
        server.down()
    else:
        server.serve(**fault)
    await refetch(src)
    assert src.current() is good and src.generation == gen
    assert src.failures == 1 and src.last_error.startswith(kind), src.last_error
    r = services.readiness()["jwks"]["corp"]
    assert r["usable"] and r["last_error"].startswith(kind) and r["failures_in_a_row"] == 1
    # the next good answer is taken
    if server._httpd is None:
        server.up()
    server.serve(mint.jwks(K1, K2))
    await refetch(src)
    ks = src.current()
    assert ks is not None and "k2" in ks.by_kid and src.failures == 0


async def test_unknown_kid_refetch_is_single_flight_and_cooled_down(
    server: JwksServer, services: Services
) -> None:
    _, src = await loaded(services, spec(server, unknown_kid_cooldown_s=30))
    server.serve(mint.jwks(K1), delay_s=0.3)
    tasks = [src.fetch_to_wait_for() for _ in range(200)]
    assert all(t is tasks[0] for t in tasks)  # one fetch, everyone waits on it
    assert tasks[0] is not None
    await asyncio.wait_for(asyncio.shield(tasks[0]), 5)
    assert all(src.fetch_to_wait_for() is None for _ in range(200))  # cooldown: decide now
    assert server.count() == 2


async def test_set_dropped_after_max_stale(server: JwksServer, services: Services) -> None:
    _, src = await loaded(services, spec(server, cache_s=0.3, max_stale_s=0.8))
    server.down()
    gen = src.generation
    await until(lambda: src.current() is None, timeout=10)
    assert src.generation == gen + 1 and src.failures >= 1
    assert services.readiness()["jwks"]["corp"]["usable"] is False


async def test_background_refresh_picks_up_rotation(server: JwksServer, services: Services) -> None:
    _, src = await loaded(services, spec(server, cache_s=0.3))
    first = src.current()
    assert first is not None
    server.serve(mint.jwks(K2))  # k1 removed, k2 added
    gen = src.generation
    await until(lambda: (ks := src.current()) is not None and "k2" in ks.by_kid)
    ks = src.current()
    assert ks is not None and "k1" not in ks.by_kid and src.generation == gen + 1


async def test_a_reload_finds_the_source_as_it_was(server: JwksServer, services: Services) -> None:
    owner, src = await loaded(services, spec(server))
    ks, fetches = src.current(), server.count()
    new_spec = spec(server, cache_s=60)  # same URL, new parameters
    again = owner.source("corp", new_spec)
    assert again.params.ttl == 30  # not before the policy goes live
    owner.activate([(again, "corp", new_spec)])
    await asyncio.sleep(0.3)
    assert again is src and src.current() is ks and server.count() == fetches
    assert src.params.ttl == 60
    other = JwksServer()
    try:
        other.serve(mint.jwks(K2))
        other_spec = spec(other)
        new = owner.source("corp", other_spec)
        owner.activate([(new, "corp", other_spec)])  # the old URL is no longer named: closed
        assert src.closed and src.fetch_to_wait_for() is None
        await until(lambda: new.current() is not None)
    finally:
        other.close()


async def test_file_source(tmp_path: Path, services: Services) -> None:
    f = tmp_path / "jwks.json"
    f.write_text(json.dumps(mint.jwks(K1)))
    _, src = await loaded(services, JwksSpec(file=str(f), unknown_kid_cooldown_s=0.1))
    f.write_text("not json")
    await refetch(src)
    assert src.current() is not None and src.last_error.startswith("invalid")
    f.unlink()
    await refetch(src)
    assert src.current() is not None and src.last_error.startswith("unreadable")


def test_schedule() -> None:
    p = kr.RefreshParams(ttl=600, max_stale=3600, cooldown=30)
    assert 540 <= kr.after_success(p, 0, 0.999) <= kr.after_success(p, 0, 0.0) == 600
    steps = [kr.after_failure(p, 0, n, 1.0) for n in range(1, 9)]
    assert steps == [1, 2, 4, 8, 16, 32, 60, 60]
    assert kr.after_failure(p, 0, 3, 0.0) == 2  # jitter: 50-100 %
    short = kr.RefreshParams(ttl=5, max_stale=10, cooldown=1)
    assert kr.after_failure(short, 0, 10, 1.0) == 5  # never later than the TTL schedule
    assert kr.usable(p, 0.0, 3600) and not kr.usable(p, 0.0, 3600.1) and not kr.usable(p, None, 0)
    assert kr.miss_may_fetch(p, None, 0) and not kr.miss_may_fetch(p, 0.0, 29.9)
    assert kr.miss_may_fetch(p, 0.0, 30)
