"""JWKS faults against a live gateway, with a real HTTP JWKS server the test controls: a failing
endpoint keeps the last good keys, rotation works both ways, an unknown-kid flood stays within
the cooldown bound, a reload under traffic neither refetches nor forgets verified tokens."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.auth import mint
from tests.auth.jwks_server import JwksServer
from tests.auth.live import LiveGateway, bearer, policy, start
from tests.integration.conftest import Backend
from tests.support import wait_until

pytestmark = pytest.mark.integration

K1 = mint.rsa_key("k1", "RS256")
K2 = mint.ec_key("k2", "ES256")
NEW = mint.rsa_key("new", "RS256")
EVIL = mint.rsa_key("evil", "RS256")
COOLDOWN_S = 1.0


def token(key: mint.Key, **over: Any) -> str:
    return mint.jws(mint.claims(**over), key)


def jwks_state(gw: LiveGateway) -> dict[str, Any]:
    state: dict[str, Any] = gw.admin("/readyz")["jwks"]["corp"]
    return state


def alt_file(tmp: Path) -> Path:
    f = tmp / "alt.json"
    f.write_text(json.dumps(mint.jwks(mint.rsa_key("alt", "PS256"))))
    return f


@pytest.fixture(scope="module")
def refreshing(
    backend: Backend, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[JwksServer, LiveGateway]]:
    """A JWKS refreshed every second (faults, rotation)."""
    server = JwksServer()
    server.serve(mint.jwks(K1, K2))
    tmp = tmp_path_factory.mktemp("jwks-fast")
    alt = alt_file(tmp)
    gw = start(
        tmp,
        lambda ports: policy(
            backend, ports, server.url, alt, cache_s=1, cooldown_s=0.5, timeout_s=1
        ),
    )
    try:
        yield server, gw
    finally:
        gw.stop()
        server.close()


@pytest.fixture(scope="module")
def steady(
    backend: Backend, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[JwksServer, LiveGateway]]:
    """A JWKS cached 10 minutes: every fetch seen is a miss refetch or a reload's doing."""
    server = JwksServer()
    server.serve(mint.jwks(K1, K2))
    tmp = tmp_path_factory.mktemp("jwks-steady")
    alt = alt_file(tmp)
    gw = start(tmp, lambda ports: policy(backend, ports, server.url, alt, cooldown_s=COOLDOWN_S))
    try:
        yield server, gw
    finally:
        gw.stop()
        server.close()


FAULTS = {
    "down": ({"down": True}, "unreachable"),
    "500": ({"status": 500, "body": b"internal error"}, "http_error"),
    "html": ({"ctype": "text/html", "body": b"<html><body>Sign in</body></html>"}, "invalid"),
    "empty keys": ({"doc": {"keys": []}}, "invalid"),
    "weak key": ({"doc": mint.jwks(mint.rsa_key("w", bits=1024))}, "invalid"),
    "huge body": ({"body": b'{"keys": [' + b" " * 400_000 + b"]}"}, "too_large"),
    "slow drip": ({"doc": mint.jwks(K1, K2), "drip_s": 0.05}, "timeout"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failing_jwks_keeps_the_last_good_keys(
    fault: str, refreshing: tuple[JwksServer, LiveGateway]
) -> None:
    server, gw = refreshing
    settings, kind = FAULTS[fault]
    wait_until(
        lambda: jwks_state(gw), 20, ok=lambda s: s["keys"] == 2 and not s["failures_in_a_row"]
    )
    before = jwks_state(gw)["fetches"]
    if settings.get("down"):
        server.down()
    else:
        server.serve(**settings)
    try:
        wait_until(
            lambda: jwks_state(gw),
            20,
            ok=lambda s: s["failures_in_a_row"] >= 2 and (s["last_error"] or "").startswith(kind),
            what=f"two failed fetches ({kind})",
        )
        state = jwks_state(gw)
        assert state["usable"] and state["keys"] == 2, state
        # known keys keep working, fresh tokens too (no cache involved)
        assert gw.http("/v1/models", bearer(token(K1, jti=uuid.uuid4().hex)))[0] == 200
        assert gw.http("/v1/models", bearer(token(K2, jti=uuid.uuid4().hex)))[0] == 200
        # an unseen kid fails closed; no built-in key
        assert gw.http("/v1/models", bearer(token(NEW)))[0] == 401
        # backoff: far fewer attempts than requests
        assert jwks_state(gw)["fetches"] - before < 30
    finally:
        if settings.get("down"):
            server.up()
        server.serve(mint.jwks(K1, K2))
    wait_until(lambda: jwks_state(gw)["failures_in_a_row"] == 0, 20, what="recovery")
    assert gw.metric("sluice_jwks_fetches_total", provider="corp", result=kind) >= 1


def test_rotation_new_kid_at_once_removed_kid_after_ttl(
    refreshing: tuple[JwksServer, LiveGateway],
) -> None:
    server, gw = refreshing
    old = token(K1)
    assert gw.http("/v1/models", bearer(old))[0] == 200  # verified and cached
    server.serve(mint.jwks(K1, K2, NEW))
    time.sleep(0.6)  # the subject: past this gateway's unknown-kid cooldown (0.5 s)
    assert gw.http("/v1/models", bearer(token(NEW)))[0] == 200  # refetch on the unknown kid
    server.serve(mint.jwks(K2, NEW))  # K1 retired
    fetches = jwks_state(gw)["fetches"]
    wait_until(lambda: jwks_state(gw)["fetches"] >= fetches + 2, 20, what="refresh after TTL")
    assert gw.http("/v1/models", bearer(old))[0] == 401  # the cached verdict went with the key
    assert gw.http("/v1/models", bearer(token(K1)))[0] == 401
    assert gw.http("/v1/models", bearer(token(NEW)))[0] == 200
    server.serve(mint.jwks(K1, K2))


async def _flood(url: str, seconds: float, concurrency: int) -> list[int]:
    statuses: list[int] = []
    stop = time.monotonic() + seconds

    async def worker(s: aiohttp.ClientSession) -> None:
        while time.monotonic() < stop:
            t = mint.jws(mint.claims(), EVIL, header={"alg": "RS256", "kid": uuid.uuid4().hex})
            async with s.get(url, headers={"authorization": f"Bearer {t}"}) as r:
                await r.read()
                statuses.append(r.status)

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
    return statuses


def test_unknown_kid_flood_stays_within_the_cooldown_bound(
    steady: tuple[JwksServer, LiveGateway],
) -> None:
    server, gw = steady
    good = token(K1)
    assert gw.http("/v1/models", bearer(good))[0] == 200
    time.sleep(COOLDOWN_S)
    before = server.count()
    t0 = time.monotonic()
    url = f"http://127.0.0.1:{gw.ports['http']}/v1/models"
    statuses = asyncio.run(_flood(url, 3.0, 16))
    elapsed = time.monotonic() - t0
    fetches = server.count() - before
    assert len(statuses) >= 50 and set(statuses) == {401}, set(statuses)
    bound = math.floor(elapsed / COOLDOWN_S) + 1
    assert 1 <= fetches <= bound, (fetches, bound, len(statuses))
    assert gw.http("/v1/models", bearer(good))[0] == 200  # cached keys untouched
    assert gw.http("/v1/models", bearer(token(K2, jti="fresh")))[0] == 200


def test_reload_under_traffic_neither_refetches_nor_forgets(
    steady: tuple[JwksServer, LiveGateway],
) -> None:
    server, gw = steady
    good = token(K1, sub="reload-user")
    assert gw.http("/v1/models", bearer(good))[0] == 200
    ok0 = gw.metric("sluice_auth_total", provider="corp", result="ok")
    fetches0 = server.count()
    errors: list[Any] = []
    done = threading.Event()

    def traffic() -> None:
        while not done.is_set():
            try:
                status = gw.http("/v1/models", bearer(good))[0]
                if status != 200:
                    errors.append(status)
            except OSError as e:
                errors.append(repr(e))

    def twenty_more_cached() -> None:  # the traffic goes on, its token taken from the cache
        start = gw.metric("sluice_auth_total", provider="corp", result="cached")
        wait_until(lambda: gw.metric("sluice_auth_total", provider="corp", result="cached"), 20,
                   ok=lambda n: n >= start + 20, what="20 more tokens from the cache")  # fmt: skip

    threads = [threading.Thread(target=traffic) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        text = gw.policy_path.read_text()
        # 1. a route change: the auth section is the same, so is the token cache
        version = gw.admin("/admin/policy")["status"]["version"]
        gw.policy_path.write_text(text.replace("name: open\n", "name: open-renamed\n"))
        assert gw.reload()["last_reload"]["ok"]
        wait_until(lambda: gw.admin("/admin/policy")["status"]["version"] != version, 20)
        twenty_more_cached()
        assert gw.metric("sluice_auth_total", provider="corp", result="ok") == ok0
        # 2. an auth change (leeway): new token cache, the same key set (no refetch)
        version = gw.admin("/admin/policy")["status"]["version"]
        changed = text.replace("forward_claims: {sub: x-sluice-user, tenant: x-sluice-tenant}",
                               "forward_claims: {sub: x-sluice-user, tenant: x-sluice-tenant}\n"
                               "      leeway_s: 30")  # fmt: skip
        assert changed != text
        gw.policy_path.write_text(changed)
        assert gw.reload()["last_reload"]["ok"]
        wait_until(lambda: gw.admin("/admin/policy")["status"]["version"] != version, 20)
        twenty_more_cached()
    finally:
        done.set()
        for t in threads:
            t.join(10)
    assert not errors, errors[:5]
    assert server.count() == fetches0  # neither reload fetched the JWKS
    ok1 = gw.metric("sluice_auth_total", provider="corp", result="ok")
    assert 1 <= ok1 - ok0 <= 4  # re-verified once after the auth change (one per racing thread)
    wait_until(lambda: gw.metric("sluice_auth_total", provider="corp", result="cached") > 10, 20)
    assert jwks_state(gw)["keys"] == 2


def test_a_reload_never_waits_on_a_jwks_fetch(steady: tuple[JwksServer, LiveGateway]) -> None:
    server, gw = steady
    slow = JwksServer()
    slow.serve(mint.jwks(mint.rsa_key("s1")), delay_s=8.0)  # answers far too late
    try:
        text = gw.policy_path.read_text()
        block = (
            "    - name: slow\n      issuer: https://slow.example/\n      audiences: [sluice]\n"
            f'      algorithms: [RS256]\n      jwks: {{url: "{slow.url}", timeout_s: 10}}\n'
        )
        gw.policy_path.write_text(text.replace("  providers:\n", "  providers:\n" + block, 1))
        fetches = server.count()
        t0 = time.monotonic()
        assert gw.reload()["last_reload"]["ok"]
        assert time.monotonic() - t0 < 3.0  # the new provider's first fetch is still running
        state = gw.admin("/readyz")["jwks"]
        assert state["slow"]["keys"] == 0 and state["corp"]["keys"] == 2
        assert gw.http("/v1/models", bearer(token(K1, sub="during-slow")))[0] == 200
        assert server.count() == fetches
    finally:
        slow.close()
