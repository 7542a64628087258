"""Two gateway processes share token budgets through a private redis-server that writes every
change to its append-only file: 40 concurrent clients exhaust a 100,000-token budget without
overspending it, and a replica SIGKILLed plus Redis restarted mid-run lose nothing."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.cli import main
from tests.integration.conftest import Backend, Gateway, start_gateway
from tests.redis_support import RedisServer
from tests.support import until, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.redis]

CLIENTS = 40
ASCII = "w" * 4000  # 1000 prompt tokens: estimated exactly
ACCENTS = "é" * 2000  # estimated 500 tokens (characters / 4); the backend counts 1000 (bytes / 4)
MAX_TOKENS = 16  # the mock backend answers 16 tokens


def replicas(backend: Backend, tmp: Path, url: str, tokens: int) -> tuple[Gateway, Gateway]:
    dirs = [tmp / "a", tmp / "b"]
    for d in dirs:
        d.mkdir()
    a, b = (start_gateway(backend, d, tail=tail(url, tokens)) for d in dirs)
    return a, b


def tail(url: str, tokens: int) -> str:
    return f"""store: {{redis: {{url: "{url}", sync_interval_ms: 50, deadline_ms: 200}}}}
budgets:
  sync_interval_ms: 50
  reservation_ttl_s: 2
  wait_ms: 500
  rules:
    - name: shared
      key: [header:x-team]
      tokens: {tokens}
      period: {{rolling: 30d}}  # (one period for the whole run, nearly always)
      when_store_down: open
"""


def admin_json(gw: Gateway, path: str) -> Any:
    try:
        with urllib.request.urlopen(f"{gw.admin}{path}", timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            return json.loads(e.read())


def wait_shared(gws: list[Gateway]) -> None:
    wait_until(
        lambda: [admin_json(g, "/readyz")["fleet"]["mode"] for g in gws],
        20,
        ok=lambda modes: all(m == "shared" for m in modes),
        interval=0.1,
        what="the fleet store shared",
    )


def show(gw: Gateway, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code = main(["budget", "show", "shared", "red", "--admin", f"127.0.0.1:{gw.admin_port}"])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    doc: dict[str, Any] = admin_json(gw, "/admin/budgets/shared/red")
    return doc


@dataclass
class Tally:
    served: int = 0  # tokens the backend reported for answered requests
    excess: int = 0  # of which above the request's reservation
    statuses: dict[int, int] = field(default_factory=dict)
    errors: int = 0  # connections that failed (a killed replica)
    refused: list[tuple[dict[str, str], Any]] = field(default_factory=list)

    def answered(self, status: int) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1


async def client(
    s: aiohttp.ClientSession, i: int, gws: list[Gateway], t: Tally, until_refused: bool,
    stop: asyncio.Event, dead: set[int],
) -> None:  # fmt: skip
    prompt = ASCII if i % 2 == 0 else ACCENTS
    reserved = len(prompt) // 4 + MAX_TOKENS
    body = {"model": "m", "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": prompt}]}  # fmt: skip
    n = 0
    while not stop.is_set() and n < 400:
        n += 1
        live = [g for j, g in enumerate(gws) if j not in dead]
        gw = live[(i + n) % len(live)]
        try:
            async with s.post(f"{gw.http}/v1/chat/completions", json=body,
                              headers={"x-team": "red"}) as r:  # fmt: skip
                doc = await r.json(content_type=None)
                t.answered(r.status)
                if r.status == 200:
                    u = doc["usage"]["prompt_tokens"] + doc["usage"]["completion_tokens"]
                    t.served += u
                    t.excess += max(0, u - reserved)
                elif r.status == 429:
                    t.refused.append((dict(r.headers), doc))
                    if until_refused:
                        return
        except (TimeoutError, aiohttp.ClientError):
            t.errors += 1
            await asyncio.sleep(0.05)


@pytest.fixture
def redis(tmp_path: Path) -> Any:
    server = RedisServer(tmp_path / "redis", appendonly=True).start()
    try:
        yield server
    finally:
        server.stop()


async def test_two_replicas_forty_clients_never_overspend(
    backend: Backend, tmp_path: Path, redis: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    budget = 100_000
    a, b = replicas(backend, tmp_path, redis.url, budget)
    t = Tally()
    try:
        wait_shared([a, b])
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            stop = asyncio.Event()
            await asyncio.gather(*(client(s, i, [a, b], t, True, stop, set())
                                   for i in range(CLIENTS)))  # fmt: skip
        assert set(t.statuses) == {200, 429} and t.errors == 0, (t.statuses, t.errors)
        assert len(t.refused) == CLIENTS
        # Charged when exhausted: the budget plus only what backends reported above the
        # reservations (prompts longer than estimated).
        assert t.served <= budget + t.excess, (t.served, t.excess)
        assert t.served > budget - 2 * 1016 * CLIENTS, t.served  # it was really used up
        headers, doc = t.refused[-1]
        assert headers["x-sluice-budget"] == "shared"
        assert doc["error"]["type"] == "budget_exceeded"
        # The store's tally is the backends' usage, exactly, once both replicas reported.
        final = await until(lambda: show(a, capsys), 10, ok=lambda d: d["used"] == t.served
                            and d["reserved"] == 0, interval=0.1)  # fmt: skip
        assert final["remaining"] == max(0, budget - t.served)
        assert show(b, capsys)["used"] == t.served
        print(f"served {t.served} tokens ({t.excess} above reservations) in "
              f"{t.statuses[200]} answers; {len(t.refused)} refused")  # fmt: skip
    finally:
        for g in (a, b):
            assert g.proc.stop() == 0, g.proc.output()


async def test_replica_killed_and_redis_restarted_mid_run(
    backend: Backend, tmp_path: Path, redis: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    budget = 50_000_000
    a, b = replicas(backend, tmp_path, redis.url, budget)
    t = Tally()
    dead: set[int] = set()
    try:
        wait_shared([a, b])
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            stop = asyncio.Event()
            run = asyncio.gather(*(client(s, i, [a, b], t, False, stop, dead)
                                   for i in range(CLIENTS)))  # fmt: skip
            served = lambda: t.statuses.get(200, 0)  # noqa: E731
            await until(served, 20, ok=lambda n: n >= 40, interval=0.05)
            served_before_kill = served()
            dead.add(1)
            b.proc.popen.send_signal(signal.SIGKILL)  # between reservations and settlements
            await until(served, 20, ok=lambda n: n >= served_before_kill + 40, interval=0.05)
            redis.restart()  # killed too: what it acknowledged is in its append-only file
            restarted = served()
            await until(lambda: admin_json(a, "/readyz")["fleet"]["mode"], 20,
                        ok=lambda m: m == "shared", interval=0.05)  # fmt: skip
            await until(served, 20, ok=lambda n: n >= restarted + 40, interval=0.05)
            stop.set()
            await run
        assert served_before_kill > 0
        # No answer of the live replica was a 5xx: with the store away the rule fails open.
        assert all(code < 500 for code in t.statuses), t.statuses
        assert set(t.statuses) == {200}, t.statuses
        # B's reservations expire after 2 s; A's syncs count them and report its own usage.
        final = await until(
            lambda: show(a, capsys), 20,
            ok=lambda d: d["reserved"] == 0 and d["expired"] > 0 and d["used"] >= t.served,
            interval=0.2,
        )  # fmt: skip
        # The tally is what was served plus at most what the dead replica held (each logged).
        assert t.served <= final["used"] <= t.served + final["expired"], (t.served, final)
        print(f"served {t.served}, tally {final['used']}, expired {final['expired']}; "
              f"{t.errors} connections to the killed replica failed")  # fmt: skip
    finally:
        assert a.proc.stop() == 0, a.proc.output()
        b.proc.stop()
    out = a.proc.output()
    assert "counted as spent" in out and "not heard from" in out
    assert "the store answers again" in out or "fleet store: fallback -> shared" in out
