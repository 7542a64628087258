"""Backends with real processes: failover when a member dies under load, a stream cut by a dying
backend, the slow-call breaker, bounded half-open probes, the canary guard, priority failover,
and a reload under load that keeps breaker and health state."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest

from tests.integration.backends_support import (
    CHAT,
    Load,
    Sim,
    Spawn,
    rewrite,
    start_gateway,
)
from tests.support import free_port, until

pytestmark = pytest.mark.integration


def endpoints(sims: list[Sim], priority: dict[int, int] | None = None) -> str:
    prio = priority or {}
    return ", ".join(
        f'{{address: "{s.address}", priority: {prio.get(i, 0)}}}' for i, s in enumerate(sims)
    )


async def test_member_killed_under_load_fails_only_its_requests_in_flight(
    tmp_path: Path, spawn: Spawn
) -> None:
    sims = spawn(3, "--ttft-ms", "15", "--completion-tokens", "1")
    gw = start_gateway(tmp_path, f"""\
timeouts: {{connect_s: 1, first_byte_s: 5}}
backends:
  - name: pool
    endpoints: [{endpoints(sims)}]
    breaker: {{consecutive_failures: 3, open_s: 30, max_open_s: 60}}
routes:
  - name: chat
    match: {{path_prefix: /v1/}}
    backend: pool
    retries: {{attempts: 3, min_retries: 8}}
""")  # fmt: skip
    # min_retries: 8 lets every client retry at once (the retry budget is tested on its own):
    # on a loaded machine the breaker takes longer to open and more connects fail together.
    try:
        async with Load(gw.url, workers=8) as load:
            before = await until(lambda: [s.served() for s in sims], what="all three served",
                                 ok=lambda ns: all(n > 0 for n in ns))  # fmt: skip
            killed_at = time.monotonic()
            sims[0].kill()
            await until(lambda: load.ok(since=killed_at + 0.2) >= 30, 30)
        failed = load.failures()
        # Only requests in flight to the dead member fail (at most one per client), and only
        # because they were sent already: connect failures after the death were retried.
        assert len(failed) <= 8, failed
        assert all(a.error == "upstream_protocol_error" for a in failed), failed
        assert all(a.start < killed_at + 0.05 for a in failed), failed
        after = load.ok(since=killed_at + 0.2)
        moved = sum(s.served() for s in sims[1:]) - sum(before[1:])
        assert after >= 30 and moved >= after  # its share went to the others
        assert gw.member("pool", sims[0].address)["breaker"]["state"] == "open"
    finally:
        gw.stop()


async def test_connect_failures_are_retried_on_another_member(tmp_path: Path, spawn: Spawn) -> None:
    """One member never listens: every try that picks it fails to connect and is retried on the
    live one, so the client sees no failure, and the retries are counted."""
    (live,) = spawn(1, "--ttft-ms", "1", "--completion-tokens", "1")
    dead = f"127.0.0.1:{free_port()}"
    gw = start_gateway(tmp_path, f"""timeouts: {{connect_s: 1, first_byte_s: 5}}
backends:
  - name: pool
    endpoints: [{{address: "{live.address}"}}, {{address: "{dead}"}}]
routes:
  - name: chat
    match: {{path_prefix: /v1/}}
    backend: pool
    retries: {{attempts: 2, budget_ratio: 1.0}}
""")  # fmt: skip
    try:
        async with aiohttp.ClientSession() as c:
            for _ in range(20):
                async with c.post(f"{gw.url}/v1/chat/completions", json=CHAT) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
        text = gw.metrics()
        line = next(
            x for x in text.splitlines()
            if x.startswith('sluice_retries_total{result="attempted",route="chat"}')
        )  # fmt: skip
        assert float(line.rsplit(" ", 1)[1]) >= 1
    finally:
        gw.stop()


async def test_backend_killed_mid_stream_ends_the_sse_stream_cleanly(
    tmp_path: Path, spawn: Spawn
) -> None:
    (sim,) = spawn(1, "--ttft-ms", "10", "--token-delay-ms", "100",
                        "--completion-tokens", "50")  # fmt: skip
    gw = start_gateway(tmp_path, f"""\
backends:
  - name: pool
    endpoints: [{endpoints([sim])}]
routes:
  - name: chat
    match: {{path_prefix: /v1/}}
    backend: pool
    retries: {{attempts: 3}}
""")  # fmt: skip
    try:
        body = {**CHAT, "stream": True, "max_tokens": 50}
        events: list[str] = []
        async with (
            aiohttp.ClientSession() as session,
            session.post(gw.url + "/v1/chat/completions", json=body) as r,
        ):
            assert r.status == 200
            async for line in r.content:
                text = line.decode().strip()
                if not text:
                    continue
                events.append(text)
                if len(events) == 2:
                    sim.kill()
            # the body ended normally (chunked end): no exception, no truncated-200 hang
        assert len(events) < 50
        err = json.loads(events[-2].removeprefix("data: "))
        assert err["error"]["type"] == "upstream_protocol_error"
        assert events[-1] == "data: [DONE]"
    finally:
        gw.stop()


async def test_slow_member_trips_the_slow_call_breaker_by_first_byte(
    tmp_path: Path, spawn: Spawn
) -> None:
    slow, fast = spawn(2, "--token-delay-ms", "80", "--completion-tokens", "8")
    slow.knobs(ttft_ms=1200)  # hangs far past slow_call_s before its first byte
    fast.knobs(ttft_ms=10)  # streams for ~0.6 s, but its first byte comes at once
    gw = start_gateway(tmp_path, f"""\
backends:
  - name: pool
    endpoints: [{endpoints([slow, fast])}]
    breaker: {{slow_call_s: 0.3, slow_ratio: 0.5, min_requests: 4, window_s: 30, open_s: 30,
              max_open_s: 60}}
routes:
  - name: chat
    match: {{path_prefix: /v1/}}
    backend: pool
""")  # fmt: skip
    try:
        body = {**CHAT, "stream": True, "max_tokens": 8}
        async with Load(gw.url, workers=4, body=body) as load:
            await until(lambda: gw.member("pool", slow.address)["breaker"]["state"] == "open", 20)
            slow.reset()
            fast.reset()
            t = await load.answered(20)
        assert not load.failures()
        assert load.ok(since=t) > 0 and slow.served() == 0 and fast.served() > 0
        m = gw.member("pool", fast.address)["breaker"]
        assert m["state"] == "closed" and m["window"]["slow"] == 0  # long streams are not slow
        assert "slow-call ratio" in gw.member("pool", slow.address)["breaker"]["last_change"]
    finally:
        gw.stop()


async def test_half_open_admits_bounded_probes_and_a_hanging_probe_reopens(
    tmp_path: Path, spawn: Spawn
) -> None:
    bad, good = spawn(2, "--ttft-ms", "5", "--completion-tokens", "1")
    bad.knobs(failure="http_5xx")
    gw = start_gateway(tmp_path, f"""\
timeouts: {{first_byte_s: 3}}
backends:
  - name: pool
    endpoints: [{endpoints([bad, good])}]
    breaker: {{consecutive_failures: 2, open_s: 0.5, max_open_s: 0.6, half_open_probes: 2,
              probe_timeout_s: 0.5}}
routes:
  - name: chat
    match: {{path_prefix: /v1/}}
    backend: pool
""")  # fmt: skip
    try:
        async with Load(gw.url, workers=2):
            await until(lambda: gw.member("pool", bad.address)["breaker"]["reopens"] >= 1)
            bad.knobs(failure="hang")  # the probes to come will hang
            bad.reset()
            await asyncio.sleep(0.1)
            load_more = Load(gw.url, workers=8)
            async with load_more:
                # half-open: at most 2 probes reach it; they hang; the breaker re-opens anyway
                await until(lambda: bad.stats()["in_flight"] >= 1, 5)
                await until(
                    lambda: "unanswered" in gw.member("pool", bad.address)["breaker"]
                    .get("last_change", ""), 5)  # fmt: skip
                reopened = gw.member("pool", bad.address)["breaker"]["reopens"]
                await until(lambda: gw.member("pool", bad.address)["breaker"]["reopens"], 15,
                            ok=lambda n: n >= reopened + 2,
                            what="two more open/half-open rounds while probes hang")  # fmt: skip
                await until(lambda: load_more.ok() >= 20, 30)
            rounds = gw.member("pool", bad.address)["breaker"]["reopens"]
            served = bad.served()
            # every half-open round admits 2 probes, no more, however many clients wait
            assert 1 <= served <= 2 * rounds, (served, rounds)
            bad.knobs(failure="none")
            await until(lambda: gw.member("pool", bad.address)["breaker"]["state"] == "closed", 10)
    finally:
        gw.stop()


async def test_failing_canary_is_guarded_to_weight_zero_and_stable_is_unaffected(
    tmp_path: Path, spawn: Spawn
) -> None:
    s1, s2, canary = spawn(3, "--ttft-ms", "5", "--completion-tokens", "1")
    canary.knobs(failure="http_5xx")
    gw = start_gateway(tmp_path, f"""\
backends:
  - name: vllm
    endpoints: [{endpoints([s1, s2])}]
  - name: vllm-canary
    endpoints: [{endpoints([canary])}]
routes:
  - name: chat
    match: {{protocol: http, path_prefix: /v1/}}
    backends: [{{backend: vllm, weight: 80}}, {{backend: vllm-canary, weight: 20}}]
    canary: {{backend: vllm-canary, p95_ms: 200, max_error_ratio: 0.02, window_s: 60,
             min_requests: 10, override_header: x-sluice-canary}}
""")  # fmt: skip
    try:
        async with Load(gw.url, workers=4) as load:
            await until(lambda: gw.backends()["routes"]["chat"]["canary"]["tripped"], 15)
            tripped_at = time.monotonic()
            await until(lambda: load.ok(since=tripped_at + 0.1) >= 20, 30)
        state = gw.backends()["routes"]["chat"]
        assert state["weights"] == {"vllm": 80.0, "vllm-canary": 0.0}
        assert "error ratio" in state["canary"]["reason"]
        # every failure the clients saw came from the canary; stable answered everything
        assert len(load.failures()) == canary.stats()["failed"] > 0
        assert s1.stats()["failed"] == s2.stats()["failed"] == 0
        assert not load.failures(since=tripped_at + 0.1)
        assert 'sluice_canary_guarded{backend="vllm-canary",route="chat"} 1.0' in gw.metrics()
        # the override header still reaches the guarded canary (an explicit opt-in)
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                gw.url + "/v1/chat/completions", json=CHAT, headers={"x-sluice-canary": "1"}
            ) as r,
        ):
            assert r.status == 500
        assert "canary guard tripped: route=chat backend=vllm-canary" in gw.stop()
    finally:
        if gw.proc.popen.poll() is None:
            gw.stop()


async def test_priority_failover_to_the_secondary_pool(tmp_path: Path, spawn: Spawn) -> None:
    sims = spawn(3, "--ttft-ms", "10", "--completion-tokens", "1")
    gw = start_gateway(tmp_path, f"""\
timeouts: {{connect_s: 1}}
backends:
  - name: pool
    endpoints: [{endpoints(sims, {2: 1})}]
    breaker: {{consecutive_failures: 2, open_s: 30, max_open_s: 60}}
routes:
  - name: chat
    match: {{path_prefix: /v1/}}
    backend: pool
    retries: {{attempts: 3}}
""")  # fmt: skip
    try:
        async with Load(gw.url, workers=4) as load:
            await load.answered(20)
            assert sims[2].served() == 0  # the secondary waits while the primary is whole
            killed_at = time.monotonic()
            sims[0].kill()
            sims[1].kill()
            await until(lambda: load.ok(since=killed_at + 0.3) >= 20, 30)
        assert not load.failures(since=killed_at + 0.3)
        assert len(load.failures()) <= 4  # only requests in flight to the dead members
        assert sims[2].served() >= 20
        levels = gw.backends()["backends"]["pool"]["levels"]
        assert [lv["priority"] for lv in levels] == [1]
    finally:
        gw.stop()


async def test_reload_under_load_keeps_breaker_and_health_state(
    tmp_path: Path, spawn: Spawn
) -> None:
    sims = spawn(4, "--ttft-ms", "5", "--completion-tokens", "1")
    broken, sick = sims[0], sims[1]
    broken.knobs(failure="http_5xx")
    sick.knobs(healthy=False)

    def body(idle: int) -> str:
        return f"""\
timeouts: {{idle_s: {idle}}}
backends:
  - name: pool
    endpoints: [{endpoints(sims)}]
    breaker: {{consecutive_failures: 3, open_s: 60, max_open_s: 60}}
    health: {{interval_s: 0.3, failing_interval_s: 0.1, unhealthy_after: 2, healthy_after: 2}}
routes:
  - name: chat
    match: {{path_prefix: /v1/}}
    backend: pool
"""

    gw = start_gateway(tmp_path, body(60))
    try:
        async with Load(gw.url, workers=4) as load:
            await until(
                lambda: gw.member("pool", broken.address)["breaker"]["state"] == "open"
                and not gw.member("pool", sick.address)["health"]["healthy"], 10
            )  # fmt: skip
            open_for = gw.member("pool", broken.address)["breaker"]["open_for_s"]
            for s in sims:
                s.reset()
            started = time.monotonic()
            for idle in (61, 62, 63):  # three reloads while requests run
                old = gw.version()
                rewrite(gw, body(idle))
                await until(lambda old=old: gw.version() != old, 10)  # type: ignore[misc]
            await until(lambda: load.ok(since=started) >= 20, 30)
        b = gw.member("pool", broken.address)
        h = gw.member("pool", sick.address)
        assert b["breaker"]["state"] == "open" and b["breaker"]["reopens"] == 1
        assert b["breaker"]["open_for_s"] < open_for  # the same open period, not a new one
        assert h["health"]["healthy"] is False
        assert broken.served() == 0 and sick.served() == 0  # kept out across the reloads
        assert not load.failures(since=started)
    finally:
        gw.stop()
