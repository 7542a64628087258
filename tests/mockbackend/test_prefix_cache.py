"""The simulated backend's prefix cache: blocks keyed by their whole prefix in an LRU, and a
time to first token that pays for uncached prompt tokens only; its model list and failure
modes before the first token."""

from __future__ import annotations

import time

import aiohttp
import pytest

from gateway.mockbackend.prefix_cache import PrefixCache


@pytest.mark.parametrize(
    ("prompts", "capacity", "uncached"),
    [
        (["a" * 40], 10, [40]),
        (["a" * 40, "a" * 40], 10, [40, 0]),
        (["a" * 40, "a" * 40 + "b" * 10], 10, [40, 10]),  # shares its first 4 blocks
        (["a" * 40, "b" + "a" * 39], 10, [40, 40]),  # same text later: another prefix
        (["a" * 40, "c" * 40, "a" * 40], 4, [40, 40, 40]),  # evicted (LRU of 4 blocks)
        (["a" * 40, "c" * 20, "a" * 40], 6, [40, 20, 0]),  # all fit
        (["a" * 40, "c" * 20, "a" * 40], 5, [40, 20, 40]),  # its first block went: all of it
        (["a" * 40, "a" * 40], 0, [40, 40]),  # no cache
    ],
)
def test_lookup(prompts: list[str], capacity: int, uncached: list[int]) -> None:
    cache = PrefixCache()
    assert [cache.lookup(p, 10, capacity) for p in prompts] == uncached


async def test_a_cached_prefix_makes_the_first_token_come_sooner(
    http: aiohttp.ClientSession, admin: aiohttp.ClientSession
) -> None:
    patch = {"prefix_cache_blocks": 64, "uncached_token_ms": 1.0, "prefill_slots": 1}
    assert (await admin.post("/admin/knobs", json=patch)).status == 200
    system = {"role": "system", "content": "s" * 2048}  # 512 tokens: 0.5 s uncached

    async def ttft(user: str) -> float:
        body = {"model": "m", "messages": [system, {"role": "user", "content": user}],
                "stream": True, "max_tokens": 1}  # fmt: skip
        t0 = time.monotonic()
        async with http.post("/v1/chat/completions", json=body) as r:
            await r.content.readline()
            return time.monotonic() - t0

    cold = await ttft("first question")
    warm = await ttft("second question")
    assert cold >= 0.5 and warm < 0.25, (cold, warm)
    stats = await (await admin.get("/admin/stats")).json()
    assert stats["prefix_cache"]["hit_tokens"] >= 512
    await admin.post("/admin/reset", json={})
    assert await ttft("second question") >= 0.5  # the reset emptied it
