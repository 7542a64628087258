"""OpenAI-compatible HTTP surface: plain and SSE completions, errors, headers, failure knobs."""

from __future__ import annotations

import asyncio
import io
import json
import time
from typing import Any

import aiohttp
import pytest

from gateway.mockbackend import MockBackendHandle
from tests.support import until

CHAT = "/v1/chat/completions"


async def _sse(resp: aiohttp.ClientResponse) -> list[tuple[float, str]]:
    """(arrival time, data payload) for each SSE event, in order."""
    events = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            events.append((time.monotonic(), line[6:].decode().strip()))
    return events


async def test_chat_plain(http: aiohttp.ClientSession) -> None:
    body = {"model": "any-model", "messages": [{"role": "user", "content": "x" * 10}]}
    async with http.post(CHAT, json=body, headers={"x-request-id": "rid-1"}) as resp:
        assert resp.status == 200
        assert resp.headers["x-request-id"] == "rid-1"
        data = await resp.json()
    assert data["object"] == "chat.completion"
    assert data["model"] == "any-model"
    assert data["id"].startswith("chatcmpl-") and isinstance(data["created"], int)
    assert data["choices"][0]["message"]["role"] == "assistant"
    assert len(data["choices"][0]["message"]["content"].split()) == 4
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


async def test_completion_max_tokens_caps(http: aiohttp.ClientSession) -> None:
    body = {"model": "m", "prompt": "abcdefgh", "max_tokens": 2}
    async with http.post("/v1/completions", json=body) as resp:
        data = await resp.json()
    assert data["object"] == "text_completion"
    assert data["choices"][0]["finish_reason"] == "length"
    assert len(data["choices"][0]["text"].split()) == 2
    assert data["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


async def test_stream_is_paced_and_flushed(
    backend: MockBackendHandle, http: aiohttp.ClientSession
) -> None:
    await backend.update_knobs({"token_delay_ms": 60, "completion_tokens": 5})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    start = time.monotonic()
    async with http.post(CHAT, json=body) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await _sse(resp)
    end = time.monotonic()
    assert events[-1][1] == "[DONE]"
    chunks: list[dict[str, Any]] = [json.loads(e) for _, e in events[:-1]]
    assert len(chunks) == 6  # 5 tokens + the finish_reason chunk
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert len(text.split()) == 5
    # 4 delays of 60 ms: the first token must arrive well before the stream ends.
    assert end - start >= 0.24
    assert events[0][0] - start < (end - start) - 0.15


async def test_stream_usage_only_when_asked(http: aiohttp.ClientSession) -> None:
    body = {
        "model": "m",
        "prompt": "abcd",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.post("/v1/completions", json=body) as resp:
        events = [e for _, e in await _sse(resp)]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}


@pytest.mark.parametrize(
    ("payload", "status"),
    [(b"{not json", 400), (b"[1, 2]", 400), (b'{"messages": "no"}', 400), (b"x" * (2 << 20), 413)],
)
async def test_bad_requests(http: aiohttp.ClientSession, payload: bytes, status: int) -> None:
    async with http.post(CHAT, data=io.BytesIO(payload)) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


async def test_models_health_metrics(
    backend: MockBackendHandle, http: aiohttp.ClientSession
) -> None:
    async with http.get("/v1/models") as resp:
        ids = [m["id"] for m in (await resp.json())["data"]]
    assert "mock-model" in ids
    async with http.get("/healthz") as resp:
        assert resp.status == 200 and await resp.json() == {"status": "ok"}
    await backend.update_knobs({"load": 0.42, "waiting": 3})
    async with http.get("/healthz", params={"deep": "true"}) as resp:
        deep = await resp.json()
    assert deep["knobs"]["load"] == 0.42 and deep["in_flight"] == 0
    async with http.get("/metrics") as resp:
        text = await resp.text()
    assert 'vllm:kv_cache_usage_perc{model_name="mock-model"} 0.42' in text
    assert 'vllm:num_requests_waiting{model_name="mock-model"} 3.0' in text
    assert 'vllm:num_requests_running{model_name="mock-model"} 0.0' in text
    await backend.update_knobs({"healthy": False})
    async with http.get("/healthz") as resp:
        assert resp.status == 503


async def test_records_request_ids_and_header_names_only(
    backend: MockBackendHandle, http: aiohttp.ClientSession, admin: aiohttp.ClientSession
) -> None:
    headers = {"X-Forwarded-For": "10.0.0.1", "X-Request-Id": "r-9", "Authorization": "Bearer t"}
    async with http.post("/v1/completions", json={"prompt": "p"}, headers=headers) as resp:
        assert resp.status == 200
    seen = backend.stats.seen[-1]
    assert seen.request_id == "r-9"
    assert {"x-forwarded-for", "x-request-id", "authorization"} <= set(seen.names)
    assert "upgrade" not in seen.names
    async with admin.get("/admin/stats") as resp:
        stats = await resp.json()
    assert stats["seen"][-1] == {"request_id": "r-9", "names": list(seen.names)}
    assert "10.0.0.1" not in json.dumps(stats) and "Bearer" not in json.dumps(stats)
    assert stats["requests"] == {"POST /v1/completions": 1}
    assert stats["completed"] == 1


async def test_admin_api_is_not_on_the_inference_listener(
    backend: MockBackendHandle, http: aiohttp.ClientSession
) -> None:
    for method, path in [
        ("GET", "/admin/stats"),
        ("GET", "/admin/knobs"),
        ("POST", "/admin/knobs"),
        ("POST", "/admin/reset"),
    ]:
        async with http.request(method, path, json={"failure": "http_5xx"}) as resp:
            assert resp.status in (404, 405), (method, path)
    assert backend.knobs.failure == "none"


async def test_knobs_change_behaviour(
    http: aiohttp.ClientSession, admin: aiohttp.ClientSession
) -> None:
    async with admin.post("/admin/knobs", json={"failure": "http_5xx"}) as resp:
        assert resp.status == 200 and (await resp.json())["failure"] == "http_5xx"
    async with http.post("/v1/completions", json={"prompt": "p"}) as resp:
        assert resp.status == 500
        assert (await resp.json())["error"]["type"] == "server_error"
    async with admin.post("/admin/knobs", json={"failure": "unavailable"}) as resp:
        assert resp.status == 200
    async with http.post("/v1/completions", json={"prompt": "p"}) as resp:
        assert resp.status == 503
    async with admin.post("/admin/knobs", json={"failure": "none"}) as resp:
        assert resp.status == 200
    async with http.post("/v1/completions", json={"prompt": "p"}) as resp:
        assert resp.status == 200


@pytest.mark.parametrize(
    "patch", [{"failure": "melt"}, {"nope": 1}, {"error_rate": 2}, {"ttft_ms": "x"}, [1]]
)
async def test_bad_knobs_rejected(admin: aiohttp.ClientSession, patch: object) -> None:
    async with admin.post("/admin/knobs", json=patch) as resp:
        assert resp.status == 400
    async with admin.get("/admin/knobs") as resp:
        assert (await resp.json())["failure"] == "none"


async def test_hang_times_out_and_counts_cancelled(
    backend: MockBackendHandle, http: aiohttp.ClientSession
) -> None:
    await backend.update_knobs({"failure": "hang"})
    timeout = aiohttp.ClientTimeout(total=0.3)
    with pytest.raises(asyncio.TimeoutError):
        async with http.post("/v1/completions", json={"prompt": "p"}, timeout=timeout):
            pass
    await until(lambda: backend.stats.cancelled == 1)
    assert backend.stats.in_flight == 0


async def test_client_leaving_mid_stream_is_cancelled(
    backend: MockBackendHandle, http: aiohttp.ClientSession
) -> None:
    await backend.update_knobs({"token_delay_ms": 20, "completion_tokens": 500})
    body = {"prompt": "p", "stream": True}
    async with http.post("/v1/completions", json=body) as resp:
        await resp.content.readline()
        await until(lambda: backend.stats.in_flight == 1)
        resp.close()  # drop the connection mid-stream
    await until(lambda: backend.stats.cancelled == 1)
    assert backend.stats.completed == 0 and backend.stats.in_flight == 0


async def test_reset_mid_stream(backend: MockBackendHandle, http: aiohttp.ClientSession) -> None:
    await backend.update_knobs({"failure": "reset"})
    with pytest.raises(aiohttp.ClientError):
        async with http.post("/v1/completions", json={"prompt": "p", "stream": True}) as resp:
            assert resp.status == 200
            await resp.read()
    with pytest.raises(aiohttp.ClientError):
        async with http.post("/v1/completions", json={"prompt": "p"}) as resp:
            await resp.read()
    await until(lambda: backend.stats.failed == 2)


async def test_error_rate_is_seeded(
    backend: MockBackendHandle, http: aiohttp.ClientSession
) -> None:
    async def run() -> list[int]:
        await backend.update_knobs({"error_rate": 0.5, "seed": 7})
        statuses = []
        for _ in range(20):
            async with http.post("/v1/completions", json={"prompt": "p"}) as resp:
                statuses.append(resp.status)
        return statuses

    first, second = await run(), await run()
    assert first == second and {200, 500} == set(first)


async def test_admin_reset(http: aiohttp.ClientSession, admin: aiohttp.ClientSession) -> None:
    async with http.post("/v1/completions", json={"prompt": "p"}):
        pass
    async with admin.post("/admin/reset") as resp:
        stats = await resp.json()
    assert stats["requests"] == {} and stats["completed"] == 0 and stats["seen"] == []


async def test_slots_bound_the_completions_generating_at_once(
    backend: MockBackendHandle, http: aiohttp.ClientSession
) -> None:
    await backend.update_knobs({"slots": 2, "ttft_ms": 100, "completion_tokens": 1})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    async def one() -> float:
        start = time.monotonic()
        async with http.post(CHAT, json=body) as resp:
            assert resp.status == 200
            await resp.read()
        return time.monotonic() - start

    took = sorted(await asyncio.gather(*(one() for _ in range(6))))
    assert backend.stats.peak_generating == 2 and backend.stats.generating == 0
    assert took[-1] >= 0.29  # three rounds of two: the last ones waited for two others


async def test_a_client_leaving_while_waiting_for_a_slot_frees_its_turn(
    backend: MockBackendHandle, http: aiohttp.ClientSession
) -> None:
    await backend.update_knobs({"slots": 1, "ttft_ms": 300, "completion_tokens": 1})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    first = asyncio.ensure_future(http.post(CHAT, json=body))
    await until(lambda: backend.stats.generating == 1)
    waiting = asyncio.ensure_future(http.post(CHAT, json=body))
    await until(lambda: len(backend.state.slots.waiters) == 1)
    waiting.cancel()
    await until(lambda: backend.stats.cancelled == 1)
    assert not backend.state.slots.waiters
    resp = await first
    assert resp.status == 200
    resp.release()
    await until(lambda: backend.stats.generating == 0)
