"""Feature sections reach /admin/state and the page without page changes.

A real in-process server (its own simulated backend, free ports); the feature owners here
return the shapes documented in `gateway.status` (limits, backends health), standing in for
the features built beside this one; the rollout section is the real one, of a staged rollout.
The page must render them: colour from the `colour` fields, tables from lists of dicts, worst
first, units on the numbers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import aiohttp
import pytest

from gateway.policy.model import Rollout as RolloutSpec
from gateway.registry.pool import BACKENDS
from gateway.server import Server
from gateway.services import ServiceKey
from gateway.status.state import merge
from tests.status.browser import ARGS, CHROMIUM
from tests.support import free_port, require

POLICY = """\
version: 1
listeners:
  http: {{host: 127.0.0.1, port: {http}}}
  grpc: null
  admin: {{host: 127.0.0.1, port: {admin}}}
mock_backend: {{enabled: true, http: "127.0.0.1:{mock}", grpc: null}}
backends:
  - name: sim-http
    protocol: http
    endpoints: [{{address: "127.0.0.1:{mock}"}}, {{address: "127.0.0.1:{spare}"}}]
    breaker: {{}}
    outlier: {{}}
    health: {{interval_s: 60}}
routes:
  - name: all
    match: {{protocol: http}}
    backend: sim-http
"""


class Limits:
    def state(self) -> dict[str, Any]:
        return {
            "colour": "red",
            "history": [{"t": 1.0, "colour": "green"}, {"t": 2.0, "colour": "red"}],
            "rules": [
                {"name": "per-tenant", "qps_util": 0.2, "token_util": 0.1, "pressure": 0.2},
                {
                    "name": "per-ip",
                    "qps_util": 0.97,
                    "token_util": 0.4,
                    "pressure": 0.97,
                    "colour": "red",
                },  # fmt: skip
            ],
            "rejections": {"rate_limited": 12},
        }


class RateLimit:
    """The shape the rate-limit owner gives today: colour histories as [seconds_ago, colour]
    pairs per scope, a rule's hottest keys as a nested list."""

    def state(self) -> dict[str, Any]:
        hot = [{"key": "10.0.0.7", "colour": "yellow", "qps_utilisation": 0.81, "pressure": 0.8}]
        return {
            "mode": "redis",
            "colour": "yellow",
            "history": {"gateway": [[30, "green"], [20, "yellow"]], "keys": [[10, "red"]]},
            "rules": [{"name": "per-key", "enforce": True, "keys": 12, "hot": hot}],
        }


# Stand-ins for feature owners whose /admin/state sections the page must render (one is the
# shape the real limiter gives; no limiter runs in this gateway, so its key name is free).
LIMITS: Final = ServiceKey[Limits]("limits")
RATELIMIT: Final = ServiceKey[RateLimit]("ratelimit")


def break_member(srv: Server, address: str) -> None:
    """The real backends owner (gateway.registry.pool): one member's breaker open, ejected as
    an outlier and failing its health checks, as real failures would leave it."""
    pool = srv.gateway.services.peek(BACKENDS)
    m = pool.latest["sim-http"].members[address]
    now = pool.clock.now()
    for _ in range(5):
        m.breaker.record(m.breaker.allow(now), now, True, False)
    m.outlier.eject(now)
    for _ in range(3):
        m.health.observe(False, "connection refused")
    m.core.load = 90.0  # its heartbeat said 90 % (shown as such)
    m.core.in_flight = 3  # requests still held by it
    pool.changed()


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[Server, int, str]]:
    ports = {"http": free_port(), "admin": free_port(), "mock": free_port(), "spare": free_port()}
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(**ports))
    srv = Server(policy)
    await srv.start()
    spare = f"127.0.0.1:{ports['spare']}"
    srv.gateway.services.get(LIMITS, Limits)
    break_member(srv, spare)
    # The real rollout section: a staged rollout held at its first stage.
    policy.write_text(
        POLICY.format(**ports).replace("version: 1", "version: 1\nguard: {min_requests: 7}")
    )
    srv.gateway.holder.reload(rollout=RolloutSpec(stages=[10, 100], hold_s=3600))
    srv.gateway.services.get(RATELIMIT, RateLimit)
    try:
        yield srv, ports["admin"], spare
    finally:
        await srv.drain_and_close()


def test_merge_rules() -> None:
    base = {"a": {"x": 1, "rows": [{"name": "n", "v": 1}]}, "l": [1, 2]}
    extra = {"a": {"rows": [{"name": "n", "w": 2}, {"name": "m"}]}, "l": [3], "b": 4}
    assert merge(base, extra) == {
        "a": {"x": 1, "rows": [{"name": "n", "v": 1, "w": 2}, {"name": "m"}]},
        "l": [3],
        "b": 4,
    }
    by_address = merge([{"address": "a", "k": 1}], [{"address": "a", "k": 2}, {"address": "b"}])
    assert by_address == [{"address": "a", "k": 2}, {"address": "b"}]


async def test_feature_sections_in_state_and_page(
    server: tuple[Server, int, str], tmp_path: Path
) -> None:
    _, admin, spare = server
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{admin}/admin/state") as r:
            assert r.status == 200
            doc = await r.json()
        async with s.get(f"http://127.0.0.1:{admin}/status/status.js") as r:
            assert r.status == 200 and r.content_type == "text/javascript"
        async with s.get(f"http://127.0.0.1:{admin}/status/nope.js") as r:
            assert r.status == 404
    assert doc["limits"]["rules"][1]["name"] == "per-ip"
    (backend,) = doc["backends"]["backends"]
    members = {m["address"]: m for m in backend["members"]}
    assert members[spare]["breaker"]["state"] == "open" and members[spare]["colour"] == "red"
    assert members[spare]["healthy"] is False and members[spare]["ejected"] is True
    assert backend["members"][0]["address"] == spare  # worst first
    assert backend["colour"] == "yellow"  # one of two members down
    assert doc["colour"] == "red"
    assert doc["reasons"][0] == "limits: red"
    assert "ratelimit: yellow" in doc["reasons"]
    assert doc["rollout"]["stage"] == "10%" and doc["rollout"]["colour"] == "green"
    assert doc["backends"]["routes"] == {"all": {"weights": {"sim-http": 1.0}}}

    try:
        from playwright.async_api import async_playwright
    except ImportError:
        async_playwright = None
    require(async_playwright is not None and CHROMIUM.exists(), "needs playwright and chromium")
    assert async_playwright is not None
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            page = await browser.new_page(viewport={"width": 1200, "height": 1000})
            await page.goto(f"http://127.0.0.1:{admin}/status")
            await page.wait_for_selector("#banner[data-colour=red]", timeout=15_000)
            assert "rollout: 10%" in await page.inner_text("#summary")
            limits = page.locator("#s-limits")
            assert (await limits.locator("h2 .badge").inner_text()).lower() == "red"
            first = await limits.locator("table:has-text('per-ip') tbody tr").nth(0).inner_text()
            assert "per-ip" in first and "97 %" in first  # worst first, as a percentage
            assert await limits.locator(".strip span").count() == 2  # its own colour history
            member = page.locator("#s-backends tr", has_text=spare)
            text = await member.inner_text()
            assert "open" in text and "90 %" in text and "3 req" in text and "no" in text
            assert "rate_limited: 12 req" in await limits.inner_text()
            rl = page.locator("#s-ratelimit")
            assert await rl.locator(".strip").count() == 2  # gateway and keys histories
            hot = await rl.locator("tr", has_text="10.0.0.7").inner_text()
            assert "81 %" in hot  # the rule's nested hottest keys, as their own table
            await page.screenshot(path=str(tmp_path / "sections.png"), full_page=True)
        finally:
            await browser.close()
