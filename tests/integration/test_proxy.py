"""End to end through a real gateway process in front of the real simulated backend."""

from __future__ import annotations

import io
import json
import time

import aiohttp
import grpc
import pytest

from gateway.proto import load
from tests.integration.conftest import Backend, Gateway
from tests.support import until

pytestmark = pytest.mark.integration

pb2, pb2_grpc = load()


async def test_http_chat_completion(gateway: Gateway) -> None:
    async with aiohttp.ClientSession() as s:
        body = {"model": "any-model", "messages": [{"role": "user", "content": "hello there"}]}
        async with s.post(f"{gateway.http}/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            data = await r.json()
            assert r.headers["x-request-id"]
    assert data["object"] == "chat.completion"
    assert data["usage"]["completion_tokens"] > 0
    assert data["choices"][0]["message"]["content"]


async def test_sse_first_chunk_arrives_before_the_stream_ends(gateway: Gateway) -> None:
    body = {
        "model": "m",
        "stream": True,
        "max_tokens": 10,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "count"}],
    }
    arrivals: list[float] = []
    events: list[str] = []
    async with aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        async with s.post(f"{gateway.http}/v1/chat/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            async for line in r.content:
                if line.startswith(b"data: "):
                    arrivals.append(time.monotonic() - t0)
                    events.append(line[6:].decode().strip())
    assert events[-1] == "[DONE]"
    usage = [json.loads(e)["usage"] for e in events[:-1] if json.loads(e).get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 10
    # 10 tokens at 20 ms each: the first chunk must not wait for the last.
    assert arrivals[-1] - arrivals[0] > 0.12, arrivals


async def test_headers_forwarded_and_hop_by_hop_dropped(gateway: Gateway, backend: Backend) -> None:
    async with aiohttp.ClientSession() as s:
        headers = {"X-Request-Id": "it-works-123", "Keep-Alive": "timeout=5", "X-Custom": "v"}
        async with s.get(f"{gateway.http}/v1/models", headers=headers) as r:
            assert r.status == 200
            assert r.headers["x-request-id"] == "it-works-123"
    seen = [s for s in backend.stats()["seen"] if s["request_id"] == "it-works-123"]
    assert seen, backend.stats()["seen"]
    names = seen[-1]["names"]  # the backend keeps header names, never values
    assert "x-forwarded-for" in names and "x-custom" in names
    assert "keep-alive" not in names


async def test_oversized_body_and_headers_are_refused(gateway: Gateway) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{gateway.http}/v1/completions", data=io.BytesIO(b"x" * (2 * 1024 * 1024))
        ) as r:
            assert r.status == 413
        async with s.get(f"{gateway.http}/v1/models", headers={"X-Big": "y" * 9000}) as r:
            assert r.status in (431, 400)
            assert r.status == 431


async def test_grpc_all_four_call_kinds(gateway: Gateway) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as ch:
        stub = pb2_grpc.InferenceStub(ch)
        reply = await stub.Infer(pb2.InferRequest(model="m", prompt="hi", max_tokens=3), timeout=5)
        assert reply.usage.completion_tokens == 3
        chunks = [
            c async for c in stub.Generate(pb2.InferRequest(prompt="x", max_tokens=4), timeout=5)
        ]
        assert len(chunks) == 4 and chunks[-1].usage.total_tokens > 0

        async def prompts():  # type: ignore[no-untyped-def]
            for p in ("a", "b", "c"):
                yield pb2.InferRequest(prompt=p)

        collected = await stub.Collect(prompts(), timeout=5)
        assert "abc" in collected.text
        call = stub.Chat(timeout=5)
        for p in ("ping1", "ping2"):
            await call.write(pb2.InferRequest(prompt=p))
            answer = await call.read()
            assert p in answer.text  # a reply per request: streaming both ways
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF


async def test_grpc_metadata_trailers_and_status_pass_through(gateway: Gateway) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as ch:
        stub = pb2_grpc.InferenceStub(ch)
        call = stub.Infer(
            pb2.InferRequest(prompt="hi"), metadata=(("x-echo-tenant", "t7"),), timeout=5
        )
        await call
        initial = dict(await call.initial_metadata())
        trailing = dict(await call.trailing_metadata())
        assert initial.get("x-echo-tenant") == "t7"
        assert int(trailing["x-mock-usage-tokens"]) > 0
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Infer(
                pb2.InferRequest(prompt="x"), metadata=(("x-mock-status", "9"),), timeout=5
            )
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert e.value.details() == "mock failure"


async def test_grpc_deadline_is_propagated(gateway: Gateway) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as ch:
        stub = pb2_grpc.InferenceStub(ch)
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Infer(
                pb2.InferRequest(prompt="x"), metadata=(("x-mock-sleep-ms", "3000"),), timeout=0.3
            )
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 1.5


def _cancelled(backend: Backend) -> int:
    return int(backend.stats()["cancelled"])


async def test_client_cancel_reaches_the_backend(gateway: Gateway, backend: Backend) -> None:
    # Earlier tests' calls (the deadline test's sleeping Infer) must have ended on the backend
    # before counting, or their late cancellation would be counted as ours.
    await until(lambda: backend.stats()["in_flight"], 5, ok=lambda n: n == 0)
    before = _cancelled(backend)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as ch:
        stub = pb2_grpc.InferenceStub(ch)
        call = stub.Generate(pb2.InferRequest(prompt="x", max_tokens=200), timeout=30)
        await call.read()
        call.cancel()
    await until(lambda: _cancelled(backend), 3, ok=lambda n: n > before)
    assert _cancelled(backend) == before + 1

    body = {"model": "m", "stream": True, "max_tokens": 200, "prompt": "x"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{gateway.http}/v1/completions", json=body) as r,
    ):
        await r.content.readline()
        # leaving the block with the body unread closes the connection: the client is gone
    await until(lambda: _cancelled(backend), 3, ok=lambda n: n > before + 1)
    assert _cancelled(backend) == before + 2


async def test_metrics_count_requests(gateway: Gateway) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{gateway.http}/v1/models") as r:
            assert r.status == 200
        async with s.get(f"{gateway.admin}/metrics") as r:
            text = await r.text()
    line = [
        x
        for x in text.splitlines()
        if x.startswith("sluice_requests_total{") and 'route="openai"' in x and 'code="200"' in x
    ]
    assert line and float(line[0].rsplit(" ", 1)[1]) >= 1
    assert "sluice_request_duration_seconds_bucket" in text
    assert "sluice_requests_in_flight 0.0" in text  # sampled every second; nothing in flight
