"""The simulated backend's /metrics tell the truth about its slots, queue and prefix cache."""

from __future__ import annotations

import asyncio

import aiohttp

from gateway.core.serverload import scan, wanted
from gateway.mockbackend import MockBackendHandle
from tests.support import until

CHAT = "/v1/chat/completions"


async def figures(http: aiohttp.ClientSession) -> tuple[float | None, ...]:
    async with http.get("/metrics") as resp:
        page = await resp.read()
    f = scan(page, wanted("vllm", {}), 0.0)
    assert f.missing == ()
    return f.running, f.waiting, f.kv_cache


async def test_running_waiting_and_kv_follow_the_slots(
    backend: MockBackendHandle, http: aiohttp.ClientSession
) -> None:
    await backend.update_knobs({"slots": 2, "ttft_ms": 5000, "completion_tokens": 1})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert await figures(http) == (0.0, 0.0, 0.0)
    calls = [asyncio.ensure_future(http.post(CHAT, json=body)) for _ in range(5)]
    await until(lambda: len(backend.state.slots.waiters) == 3)
    assert await figures(http) == (2.0, 3.0, 1.0)  # two run, three wait, every slot in use
    for c in calls:
        c.cancel()
    await until(lambda: backend.stats.generating == 0 and not backend.state.slots.waiters)
    assert await figures(http) == (0.0, 0.0, 0.0)
    await backend.update_knobs({"waiting": 4, "load": 0.5})  # load a test pretends to have
    assert await figures(http) == (0.0, 4.0, 0.5)


async def test_prefix_cache_counters(
    backend: MockBackendHandle, http: aiohttp.ClientSession
) -> None:
    await backend.update_knobs({"prefix_cache_blocks": 64, "prefix_block_chars": 16})
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}]}
    for _ in range(2):
        async with http.post(CHAT, json=body) as resp:
            assert resp.status == 200
            await resp.read()
    async with http.get("/metrics") as resp:
        text = await resp.text()
    hits = next(
        line for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total")
    )
    queries = next(
        line for line in text.splitlines() if line.startswith("vllm:prefix_cache_queries_total")
    )
    assert float(hits.split()[-1]) > 0
    assert float(queries.split()[-1]) > float(hits.split()[-1])
