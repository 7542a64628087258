"""`sluice heartbeat`: load from vLLM-style gauges, and the real agent process publishing the
simulated backend's heartbeat to a private Redis (and withdrawing it on SIGTERM)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from gateway.mockbackend import Knobs, MockBackendHandle, start_mock_backend
from gateway.registry.agent import compute_load, parse_metrics
from gateway.registry.heartbeats import member_key, read
from tests.redis_support import RedisServer
from tests.support import ROOT, free_port

pytestmark = pytest.mark.redis

METRICS = """\
# HELP vllm:num_requests_running Requests being served.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 10.0
vllm:num_requests_running{model_name="b"} 6.0
vllm:num_requests_waiting{model_name="a"} 4.0
vllm:kv_cache_usage_perc{model_name="a",note="x y"} 0.25
vllm:kv_cache_usage_perc{model_name="b"} 0.5
other_metric 7
broken_line
"""


def test_parse_and_load() -> None:
    m = parse_metrics(METRICS)
    assert m["vllm:num_requests_running"] == 16.0 and m["vllm:kv_cache_usage_perc"] == 0.5
    assert compute_load(m, max_running=256) == 50.0  # KV-cache use dominates
    assert compute_load(m, max_running=10) == 100.0  # 20 requests for 10 slots: full
    assert compute_load({"vllm:gpu_cache_usage_perc": 0.3}, 256) == 30.0  # older vLLM name
    assert compute_load({}, 256) == 0.0


@pytest.fixture
async def backend() -> AsyncIterator[MockBackendHandle]:
    handle = await start_mock_backend("127.0.0.1:0", None, Knobs(load=0.4, waiting=2))
    yield handle
    await handle.close()


async def agent(redis_url: str, address: str, *extra: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "heartbeat", "--service", "llm", "--address", address,
        "--ver", "v7", *extra,
        cwd=ROOT, env={**os.environ, "SLUICE_HEARTBEAT_REDIS": redis_url},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def test_agent_publishes_and_withdraws(
    backend: MockBackendHandle, redis_server: RedisServer
) -> None:
    address = f"127.0.0.1:{backend.http_port}"
    client = Redis.from_url(redis_server.url)
    try:
        once = await agent(redis_server.url, address, "--once")
        assert await asyncio.wait_for(once.wait(), 30) == 0
        _, beats = await read(client, "llm", 10)
        assert [(b.sid, b.addr, b.load, b.ver) for b in beats] == [(address, address, 40.0, "v7")]
        await client.delete(member_key("llm", address))
        proc = await agent(redis_server.url, address, "--interval", "0.1", "--ttl", "1")
        for _ in range(200):
            if (await read(client, "llm", 10))[1]:
                break
            await asyncio.sleep(0.05)
        ttl = await client.pttl(member_key("llm", address))
        assert 0 < ttl <= 1000
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        assert not await client.exists(member_key("llm", address))  # withdrawn at once
    finally:
        await client.aclose()


async def test_agent_publishes_nothing_while_the_server_is_down(
    redis_server: RedisServer,
) -> None:
    proc = await agent(redis_server.url, f"127.0.0.1:{free_port()}", "--once")
    assert await asyncio.wait_for(proc.wait(), 30) == 1
    assert proc.stderr is not None
    assert b"heartbeat not published" in await proc.stderr.read()
    client = Redis.from_url(redis_server.url)
    try:
        assert (await read(client, "llm", 10))[1] == []
    finally:
        await client.aclose()
