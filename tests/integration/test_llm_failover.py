"""Failover before the first token with real simulated backends: a stream whose backend resets,
sends an SSE error event, stalls or answers 5xx before any token is retried on another member
and the client sees one clean stream; a member killed under streaming load fails no stream
that had not received content, and those mid-content end with the error event."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.backends_support import Sim, Spawn, start_gateway
from tests.integration.llm_support import chat, pool_policy
from tests.support import until

pytestmark = pytest.mark.integration

PREAMBLE = {"role": "assistant", "content": ""}
ANSWER = "sluice gates hold the river while tokens flow past quietly "


def policy(sims: list[Sim]) -> str:
    return pool_policy(
        sims,
        1,
        """\
    retries: {attempts: 2, before_first_token: true, min_retries: 100}
    sticky: {header: x-user}
""",
    )


async def homes(c: httpx.AsyncClient, sims: list[Sim], n: int) -> list[list[str]]:
    """x-user values by the member (index in `sims`) their sticky hash sends them to."""
    for i in range(n):
        r = await c.post("/v1/chat/completions", json=chat("m"),
                         headers={"x-user": f"u{i}", "x-request-id": f"u{i}"})  # fmt: skip
        assert r.status_code == 200
    out: list[list[str]] = [[] for _ in sims]
    for k, s in enumerate(sims):
        out[k] = [seen["request_id"] for seen in s.stats()["seen"] if seen["request_id"]]
        s.reset()
    return out


async def stream(c: httpx.AsyncClient, user: str, got: list[Any] | None = None) -> list[Any]:
    """The events of one streamed chat answer, parsed ("[DONE]" as a string), also appended to
    `got` as they come."""
    events: list[Any] = [] if got is None else got
    body = chat("m", stream=True, max_tokens=10)
    async with c.stream("POST", "/v1/chat/completions", json=body, headers={"x-user": user}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def content(events: list[Any]) -> str:
    return "".join(
        (e["choices"][0].get("delta") or {}).get("content") or ""
        for e in events
        if isinstance(e, dict) and e.get("choices")
    )


def errors(events: list[Any]) -> list[Any]:
    return [e for e in events if isinstance(e, dict) and "error" in e]


@pytest.mark.parametrize(
    "failure", ["reset_before_first_token", "error_event", "stall_before_first_token", "http_5xx"]
)
async def test_a_backend_failing_before_the_first_token_is_retried(
    tmp_path: Path, spawn: Spawn, failure: str
) -> None:
    sims = spawn(2, "--ttft-ms", "1", "--token-delay-ms", "1")
    bad, good = sims
    gw = start_gateway(tmp_path, policy(sims))
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        on_bad = (await homes(c, sims, 12))[0]
        assert on_bad
        bad.knobs(failure=failure)
        good.knobs(role_preamble=True)
        for u in on_bad[:4]:
            events = await stream(c, u)
            assert events[-1] == "[DONE]" and not errors(events), events
            assert content(events) == ANSWER
            preambles = [e for e in events if e != "[DONE]" and e["choices"]
                         and e["choices"][0].get("delta") == PREAMBLE]  # fmt: skip
            assert len(preambles) == 1  # one: the failed member's was never sent
        assert bad.stats()["failed"] == min(4, len(on_bad))
    assert "sluice_first_token_retries_total" in gw.metrics()
    gw.stop()


async def test_a_member_killed_under_streaming_load(tmp_path: Path, spawn: Spawn) -> None:
    sims = spawn(3, "--ttft-ms", "1", "--token-delay-ms", "1")
    gw = start_gateway(tmp_path, policy(sims))
    async with httpx.AsyncClient(base_url=gw.url, timeout=20) as c:
        # Enough users that each member is home to four (the members' ports, so the hash's
        # split, differ per run: 24 left one with three in about one run in 25), then slow.
        by_member = await homes(c, sims, 60)
        doomed, others = by_member[0], by_member[1] + by_member[2]
        assert len(doomed) >= 4 and len(others) >= 2
        for s in sims:
            s.knobs(ttft_ms=400, token_delay_ms=80)
        early: list[list[Any]] = [[] for _ in range(4)]
        tasks = [asyncio.create_task(stream(c, u, early[i]))
                 for i, u in enumerate(doomed[:2] + others[:2])]  # fmt: skip
        await until(lambda: [content(e) for e in early], ok=all, what="content on all four")
        late_events: list[list[Any]] = [[], []]
        late = [asyncio.create_task(stream(c, u, late_events[i]))
                for i, u in enumerate(doomed[2:4])]  # fmt: skip
        # Both late ones have reached the doomed member (its 400 ms to the first token ahead).
        await until(lambda: sims[0].stats()["in_flight"], ok=lambda n: n == 4,
                    interval=0.01, what="the doomed member serving four streams")  # fmt: skip
        assert not any(content(e) for e in late_events)  # before their first token
        sims[0].kill()
        done = await asyncio.gather(*tasks, *late)
    for events in done[:2]:  # mid-content on the killed member: the defined error event
        assert content(events) and errors(events) and events[-1] == "[DONE]"
    for events in done[2:]:  # the others, and those retried before content: whole and clean
        assert content(events) == ANSWER and not errors(events) and events[-1] == "[DONE]"
    gw.stop()
