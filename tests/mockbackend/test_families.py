"""The simulated backend's embeddings, Responses and Messages faces: JSON and SSE with exact
usage, errors in each family's dialect, the failure knobs."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from gateway.mockbackend import MockBackendHandle


async def _events(resp: aiohttp.ClientResponse) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE event."""
    out: list[tuple[str, dict[str, Any]]] = []
    name = ""
    async for line in resp.content:
        if line.startswith(b"event: "):
            name = line[7:].decode().strip()
        elif line.startswith(b"data: "):
            out.append((name, json.loads(line[6:])))
    return out


MESSAGES = {
    "model": "m",
    "max_tokens": 3,
    "system": "abcd",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "efgh"}]}],
}


async def test_messages_json_and_stream(http: aiohttp.ClientSession) -> None:
    async with http.post("/v1/messages", json=MESSAGES) as r:
        assert r.status == 200
        doc = await r.json()
    assert doc["type"] == "message" and doc["stop_reason"] == "max_tokens"
    assert doc["usage"] == {"input_tokens": 2, "output_tokens": 3}
    assert doc["content"][0]["text"] == "sluice gates hold "
    async with http.post("/v1/messages", json={**MESSAGES, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = await _events(r)
    names = [n for n, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert names.count("content_block_delta") == 3
    assert all(d["type"] == n for n, d in events)
    assert events[0][1]["message"]["usage"]["input_tokens"] == 2
    assert events[-2][1]["usage"] == {"output_tokens": 3}
    async with http.post("/v1/messages/count_tokens", json=MESSAGES) as r:
        assert await r.json() == {"input_tokens": 2}


async def test_responses_json_and_stream(http: aiohttp.ClientSession) -> None:
    body = {"model": "m", "instructions": "abcd", "input": "efghijkl"}
    async with http.post("/v1/responses", json=body) as r:
        doc = await r.json()
    assert doc["object"] == "response" and doc["status"] == "completed"
    assert doc["usage"]["input_tokens"] == 3 and doc["usage"]["output_tokens"] == 4
    assert doc["usage"]["total_tokens"] == 7
    assert doc["output"][0]["content"][0]["text"] == "sluice gates hold the "
    async with http.post("/v1/responses", json={**body, "stream": True}) as r:
        events = await _events(r)
    names = [n for n, _ in events]
    assert names[0] == "response.created" and names[-1] == "response.completed"
    assert names.count("response.output_text.delta") == 4
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert events[-1][1]["response"]["usage"]["output_tokens"] == 4


async def test_embeddings(http: aiohttp.ClientSession) -> None:
    async with http.post("/v1/embeddings", json={"model": "e", "input": ["abcd", "abcdefgh"]}) as r:
        doc = await r.json()
    assert [d["index"] for d in doc["data"]] == [0, 1]
    assert doc["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    async with http.post("/v1/embeddings", json={"model": "e", "input": 5}) as r:
        assert r.status == 400


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/messages", MESSAGES), ("/v1/responses", {"model": "m", "input": "x"})],
)
async def test_failures_in_dialect(
    backend: MockBackendHandle, http: aiohttp.ClientSession, path: str, body: dict[str, Any]
) -> None:
    anthropic = path == "/v1/messages"
    await backend.update_knobs({"failure": "unavailable"})
    async with http.post(path, json=body) as r:
        doc = await r.json()
        assert r.status == (529 if anthropic else 503)
    assert (
        (doc["error"]["type"] == "overloaded_error") if anthropic else ("message" in doc["error"])
    )
    await backend.update_knobs({"failure": "error_event"})
    async with http.post(path, json={**body, "stream": True}) as r:
        events = await _events(r)
    assert events[-1][0] == ("error" if anthropic else "response.failed")
    assert not any(n.endswith("delta") for n, _ in events)
    await backend.update_knobs({"failure": "reset"})
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(path, json={**body, "stream": True}) as r:
            await _events(r)
    await backend.update_knobs({"failure": "none", "models": ["only"]})
    async with http.post(path, json=body) as r:
        assert r.status == 404
        doc = await r.json()
    assert (doc.get("type") == "error") == anthropic
