"""Prompt-prefix affinity with real simulated backends: the same prefix stays on one member,
losing a member moves only its prefixes (retried on the next member in the prefix's order),
and a burst of one prefix spreads within the load factor (the time-averaged bound is
tests/core/test_placement.py's and the affinity benchmark's)."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.integration.backends_support import Sim, Spawn, start_gateway
from tests.integration.llm_support import chat, pool_policy

pytestmark = pytest.mark.integration

SYSTEM = "You are a helpful assistant for group {0}. " * 20


def policy(sims: list[Sim], factor: float = 1.25) -> str:
    return pool_policy(
        sims,
        10,
        f"""\
    affinity: {{prefix: {{bytes: 512, load_factor: {factor}}}}}
    retries: {{attempts: 3}}
""",
    )


def where(sims: list[Sim]) -> dict[str, int]:
    """Request id → the index of the simulated backend that saw it."""
    out: dict[str, int] = {}
    for i, s in enumerate(sims):
        for seen in s.stats()["seen"]:
            if seen["request_id"]:
                out[seen["request_id"]] = i
    return out


async def send(c: httpx.AsyncClient, group: int, rid: str) -> None:
    body = chat("m", system=SYSTEM.format(group), user=f"question {rid}")
    r = await c.post("/v1/chat/completions", json=body, headers={"x-request-id": rid})
    assert r.status_code == 200, r.text


async def test_prefixes_stay_and_a_lost_member_moves_only_its_own(
    tmp_path: Path, spawn: Spawn
) -> None:
    sims = spawn(4, "--ttft-ms", "1", "--completion-tokens", "1")
    gw = start_gateway(tmp_path, policy(sims))
    groups = range(16)
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        for g in groups:
            for j in range(3):
                await send(c, g, f"a{g}-{j}")
        seen = where(sims)
        home = {}
        for g in groups:
            at = {seen[f"a{g}-{j}"] for j in range(3)}
            assert len(at) == 1, (g, at)  # one prefix, one member
            home[g] = at.pop()
        per = Counter(home.values())
        assert len(per) >= 3, per
        victim = per.most_common(1)[0][0]
        sims[victim].kill()
        alive = [s for i, s in enumerate(sims) if i != victim]
        for s in alive:
            s.reset()
        for g in groups:
            for j in range(2):
                await send(c, g, f"b{g}-{j}")
        seen = where(alive)
        for g in groups:
            at = {alive[seen[f"b{g}-{j}"]].port for j in range(2)}
            assert len(at) == 1, (g, at)
            if home[g] != victim:
                assert at == {sims[home[g]].port}, g  # untouched by the loss
    gw.stop()


async def test_a_burst_of_one_prefix_spreads_within_the_load_factor(
    tmp_path: Path, spawn: Spawn
) -> None:
    """160 requests of one prefix at once (the pile-up of vllm-project/router#179): placed one
    after another, each sees the others in flight, so none takes a member past
    max(ceil(1.25 x mean), mean + 8) = 50 of 160 over 4 members."""
    sims = spawn(4, "--ttft-ms", "1500", "--completion-tokens", "1")
    gw = start_gateway(tmp_path, policy(sims, 1.25))
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=gw.url, timeout=30, limits=limits) as c:
        await asyncio.gather(*(send(c, 7, f"h{i}") for i in range(160)))
    per = Counter(where(sims).values())
    assert sum(per.values()) == 160 and max(per.values()) <= 50 and len(per) >= 3, per
    gw.stop()
