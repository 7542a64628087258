"""Every API family through Sluice with the real SDKs: the openai SDK (chat, completions,
embeddings, Responses with and without a stream) and the anthropic SDK (messages.create,
messages.stream, messages.count_tokens), over both HTTP engines and HTTP/2, against simulated
backends reporting exact usage.

- A token rule's reservation settles to exactly each answer's usage (reserved − refunded +
  charged = usage), and `sluice_tokens_total` counts the same; count_tokens is not counted.
- A Messages or Responses stream whose backend fails before its first token is served by another
  member; one that fails mid-stream ends in its own dialect (the anthropic SDK raises its API
  error, the openai SDK's Responses stream reports an `error` event), never silently truncated.
- A 429 reaches the anthropic SDK as its `RateLimitError`, with Anthropic's error body and the
  retry hint, and the openai SDK as its own."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.integration.backends_support import Gw, Sim, Spawn, start_gateway
from tests.integration.llm_support import pool_policy
from tests.integration.test_llm_failover import homes
from tests.support import metric_total, until

pytestmark = pytest.mark.integration

TOKEN_RULE = """rate_limits:
  rules:
    - name: tenant
      key: ["header:x-tenant"]
      tokens_per_second: 1000000
"""
MESSAGES = [{"role": "user", "content": "how do sluices work, in a few words?"}]
ANSWER10 = "sluice gates hold the river while tokens flow past quietly "  # 10 tokens

VARIANTS = [("native", False), ("aiohttp", False), ("native", True)]  # (engine, HTTP/2)


@asynccontextmanager
async def sdks(gw: Gw, h2: bool = False, **headers: str) -> AsyncIterator[tuple[Any, Any]]:
    """An openai and an anthropic client to the gateway (h2c when `h2`); each SDK brings its
    own httpx package."""
    http = httpx.AsyncClient(http1=not h2, http2=h2, timeout=10)
    http_an = anthropic.DefaultAsyncHttpxClient(http1=not h2, http2=h2, timeout=10)
    try:
        oa = openai.AsyncOpenAI(
            base_url=gw.url + "/v1", api_key="unused", http_client=http, max_retries=0,
            default_headers=headers,
        )  # fmt: skip
        an = anthropic.AsyncAnthropic(
            base_url=gw.url, api_key="unused", http_client=http_an, max_retries=0,
            default_headers=headers,
        )  # fmt: skip
        yield oa, an
    finally:
        await http.aclose()
        await http_an.aclose()


def metrics(gw: Gw) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{gw.admin_port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def settled(text: str) -> tuple[float, float, float]:
    """(reserved − refunded + charged, input tokens, output tokens) in the gateway's metrics."""

    def rl(kind: str) -> float:
        return metric_total(text, "sluice_ratelimit_tokens_total", rule="tenant", kind=kind)

    return (
        rl("reserved") - rl("refunded") + rl("charged"),
        metric_total(text, "sluice_tokens_total", type="input"),
        metric_total(text, "sluice_tokens_total", type="output"),
    )


async def calls(oa: Any, an: Any) -> AsyncIterator[tuple[str, int, int]]:
    """Each family's call, JSON and streamed: (what, input tokens, output tokens) as the
    backend reported them to the client."""
    r: Any = await oa.chat.completions.create(model="m", messages=MESSAGES, max_tokens=20)
    yield "chat", r.usage.prompt_tokens, r.usage.completion_tokens
    last = None
    async for c in await oa.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=20, stream=True,
        stream_options={"include_usage": True},
    ):  # fmt: skip
        last = c
    assert last is not None and last.usage is not None
    yield "chat stream", last.usage.prompt_tokens, last.usage.completion_tokens
    r = await oa.completions.create(model="m", prompt="abcd" * 9, max_tokens=20)
    yield "completions", r.usage.prompt_tokens, r.usage.completion_tokens
    r = await oa.embeddings.create(model="e", input=["abcd" * 5, "efgh" * 3])
    assert len(r.data) == 2
    yield "embeddings", r.usage.prompt_tokens, 0
    r = await oa.responses.create(
        model="m", instructions="be brief", input="how do sluices work?", max_output_tokens=20
    )
    assert r.output_text == ANSWER10 + "sluice gates hold the river while "
    yield "responses", r.usage.input_tokens, r.usage.output_tokens
    done = None
    text = ""
    async for ev in await oa.responses.create(model="m", input="abcd" * 7, stream=True):
        if ev.type == "response.output_text.delta":
            text += ev.delta
        if ev.type == "response.completed":
            done = ev.response.usage
    assert done is not None and text.startswith(ANSWER10)
    yield "responses stream", done.input_tokens, done.output_tokens
    m = await an.messages.create(model="m", max_tokens=20, system="be brief", messages=MESSAGES)
    assert m.content[0].text.startswith(ANSWER10)
    yield "messages", m.usage.input_tokens, m.usage.output_tokens
    async with an.messages.stream(model="m", max_tokens=5, messages=MESSAGES) as s:
        final = await s.get_final_message()
    assert final.content[0].text == "sluice gates hold the river "
    yield "messages stream", final.usage.input_tokens, final.usage.output_tokens


@pytest.mark.parametrize(("engine", "h2"), VARIANTS, ids=["native", "aiohttp", "h2"])
async def test_each_family_settles_its_reservation_to_its_usage(
    tmp_path: Path, spawn: Spawn, engine: str, h2: bool
) -> None:
    sims = spawn(1, "--ttft-ms", "1", "--token-delay-ms", "0")
    gw = start_gateway(tmp_path, pool_policy(sims, 5, "") + TOKEN_RULE, engine=engine)
    used = inputs = outputs = 0
    async with sdks(gw, h2, **{"x-tenant": "a"}) as (oa, an):
        async for what, i, o in calls(oa, an):
            assert i > 0 and (o > 0 or what == "embeddings"), what
            used, inputs, outputs = used + i + o, inputs + i, outputs + o
            want = (used, inputs, outputs)

            def now(want: tuple[int, int, int] = want) -> bool:
                # The limiter's counters reach Prometheus once a second.
                return settled(metrics(gw)) == want

            await until(now, 5, interval=0.1, what=f"{what}: settled to its usage")
        n = await an.messages.count_tokens(model="m", messages=MESSAGES)
        assert n.input_tokens > 0
        await asyncio.sleep(1.2)  # a count of its reservation would have reached the metrics
        assert settled(metrics(gw)) == (used, inputs, outputs)
    assert sims[0].stats()["requests"]["POST /v1/messages/count_tokens"] == 1
    gw.stop()


async def test_time_to_first_token_is_the_first_output_event(tmp_path: Path, spawn: Spawn) -> None:
    """The backend sends the preamble events at once and its first token after 300 ms: TTFT is
    taken at the first output event of Responses and Messages streams, not at their preamble."""
    sims = spawn(1, "--ttft-ms", "300", "--token-delay-ms", "0")
    gw = start_gateway(tmp_path, pool_policy(sims, 5, ""))
    async with sdks(gw) as (oa, an):
        assert text_of(await responses_events(oa, "u")) == ANSWER10
        assert await messages_text(an, "u") == ANSWER10

    def observed() -> str | None:
        text = metrics(gw)
        return text if metric_total(text, "sluice_time_to_first_token_seconds_count") else None

    text = await until(observed, 5, interval=0.1, what="TTFT observed")
    assert metric_total(text, "sluice_time_to_first_token_seconds_count") == 2
    assert metric_total(text, "sluice_time_to_first_token_seconds_sum") >= 2 * 0.3
    gw.stop()


def failover_policy(sims: list[Sim]) -> str:
    return pool_policy(
        sims, 1, "    retries: {attempts: 2, before_first_token: true, min_retries: 100}\n"
        "    sticky: {header: x-user}\n",
    )  # fmt: skip


async def messages_text(an: Any, user: str) -> str:
    async with an.messages.stream(
        model="m", max_tokens=10, messages=MESSAGES, extra_headers={"x-user": user}
    ) as s:
        final = await s.get_final_message()
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10
    return str(final.content[0].text)


async def responses_events(oa: Any, user: str) -> list[Any]:
    stream = await oa.responses.create(
        model="m", input="hi", max_output_tokens=10, stream=True, extra_headers={"x-user": user}
    )
    return [ev async for ev in stream]


def text_of(events: list[Any]) -> str:
    return "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")


@pytest.mark.parametrize("failure", ["reset_before_first_token", "error_event"])
async def test_a_stream_failing_before_its_first_token_is_served_by_another_member(
    tmp_path: Path, spawn: Spawn, failure: str
) -> None:
    sims = spawn(2, "--ttft-ms", "1", "--token-delay-ms", "1")
    gw = start_gateway(tmp_path, failover_policy(sims))
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        by_member = await homes(c, sims, 12)
    k = max(range(2), key=lambda i: len(by_member[i]))  # the member most users are homed on
    bad, on_bad = sims[k], by_member[k][:4]
    bad.knobs(failure=failure)
    async with sdks(gw) as (oa, an):
        for u in on_bad:
            assert await messages_text(an, u) == ANSWER10
            events = await responses_events(oa, u)
            assert text_of(events) == ANSWER10
            kinds = [ev.type for ev in events]
            assert kinds.count("response.created") == 1 and kinds[-1] == "response.incomplete"
            assert "error" not in kinds and "response.failed" not in kinds
    assert bad.stats()["failed"] == 2 * len(on_bad)
    assert metric_total(metrics(gw), "sluice_first_token_retries_total") == 2 * len(on_bad)
    gw.stop()


@pytest.mark.parametrize(("engine", "h2"), VARIANTS, ids=["native", "aiohttp", "h2"])
async def test_a_stream_cut_mid_way_ends_in_its_own_dialect(
    tmp_path: Path, spawn: Spawn, engine: str, h2: bool
) -> None:
    sims = spawn(1, "--ttft-ms", "1", "--token-delay-ms", "1")
    gw = start_gateway(tmp_path, pool_policy(sims, 5, ""), engine=engine)
    sims[0].knobs(failure="reset")  # cut after the first token
    async with sdks(gw, h2) as (oa, an):
        got: list[str] = []
        with pytest.raises(anthropic.APIStatusError) as e:
            async with an.messages.stream(model="m", max_tokens=10, messages=MESSAGES) as s:
                async for t in s.text_stream:
                    got.append(t)
        assert got == ["sluice "]  # the one token sent, then the error: never a silent end
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "api_error"
        events = await asyncio.wait_for(responses_events(oa, "u"), 10)
        kinds = [ev.type for ev in events]
        assert kinds[-2:] == ["error", "response.failed"] and "response.completed" not in kinds
        assert text_of(events) == "sluice "
        # chat keeps its OpenAI error chunk (the SDK raises on it)
        with pytest.raises(openai.APIError):
            async for _ in await oa.chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=10, stream=True
            ):
                pass
    gw.stop()


async def test_refusals_reach_each_sdk_as_its_own_error(tmp_path: Path, spawn: Spawn) -> None:
    sims = spawn(1, "--ttft-ms", "1", "--token-delay-ms", "0")
    rule = "rate_limits:\n  rules:\n    - name: slow\n      key: []\n      qps: 0.05\n"
    gw = start_gateway(tmp_path, pool_policy(sims, 5, "") + rule)
    async with sdks(gw) as (oa, an):
        await an.messages.create(model="m", max_tokens=1, messages=MESSAGES)  # the one allowed
        with pytest.raises(anthropic.RateLimitError) as e:
            await an.messages.create(model="m", max_tokens=1, messages=MESSAGES)
        assert e.value.status_code == 429
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert e.value.body["type"] == "error"
        assert e.value.body["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError) as o:
            await oa.responses.create(model="m", input="hi")
        assert int(o.value.response.headers["retry-after"]) >= 1
        assert o.value.body["type"] == "rate_limited"  # OpenAI's shape: {"error": {...}}
    gw.stop()


async def test_anthropic_and_openai_clients_authenticate_where_they_put_the_key(
    tmp_path: Path, spawn: Spawn
) -> None:
    """The default places: the anthropic SDK's `x-api-key`, the openai SDK's `Authorization:
    Bearer`; a refusal in each one's dialect; the token never reaches the backend or the log."""
    from tests.auth import mint

    sims = spawn(1, "--ttft-ms", "1", "--token-delay-ms", "0")
    secret = tmp_path / "hs.secret"
    secret.write_bytes(mint.HS_SECRET)
    auth = f"""auth:
  default: required
  providers:
    - name: internal
      issuer: {mint.HS_ISSUER}
      audiences: [{mint.AUDIENCE}]
      algorithms: [HS256]
      secret: {{file: {secret}}}
limits: {{max_body_bytes: 4096}}
filters: [request_id, auth, route]
"""
    gw = start_gateway(tmp_path, pool_policy(sims, 5, "") + auth)
    token = mint.jws(mint.claims(iss=mint.HS_ISSUER), mint.HS_SECRET)
    http = anthropic.DefaultAsyncHttpxClient(timeout=10)
    oa_http = httpx.AsyncClient(timeout=10)
    try:
        an = anthropic.AsyncAnthropic(base_url=gw.url, api_key=token, http_client=http,
                                      max_retries=0)  # fmt: skip
        m = await an.messages.create(model="m", max_tokens=2, messages=MESSAGES)
        assert m.usage.output_tokens == 2
        oa = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=token, http_client=oa_http,
                                max_retries=0)  # fmt: skip
        r = await oa.responses.create(model="m", input="hi", max_output_tokens=2)
        assert r.usage.output_tokens == 2
        stranger = an.with_options(api_key="not-a-token")
        with pytest.raises(anthropic.AuthenticationError) as e:
            await stranger.messages.create(model="m", max_tokens=2, messages=MESSAGES)
        assert e.value.body["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.APIStatusError) as big:
            huge = [{"role": "user", "content": "x" * 8000}]
            await an.messages.create(model="m", max_tokens=2, messages=huge)
        assert big.value.status_code == 413
        assert big.value.body["error"]["type"] == "request_too_large"
    finally:
        await http.aclose()
        await oa_http.aclose()
    names = {n for seen in sims[0].stats()["seen"] for n in seen["names"]}
    assert "x-api-key" not in names and "authorization" not in names
    assert token not in gw.stop()


async def test_no_capacity_is_anthropics_overloaded_529(tmp_path: Path, spawn: Spawn) -> None:
    """Sluice's 503 (here: no healthy member) is a Messages client's 529 `overloaded_error`
    (the anthropic SDK's `OverloadedError`), and stays a 503 for the openai SDK."""
    from tests.integration.llm_support import addresses

    sims = spawn(1, "--ttft-ms", "1", "--token-delay-ms", "0")
    body = f"""backends:
  - name: pool
    endpoints: [{addresses(sims)}]
    panic_threshold: 0
    health: {{interval_s: 0.2, failing_interval_s: 0.2, unhealthy_after: 1}}
routes:
  - name: openai
    match: {{protocol: http, path_prefix: /v1/}}
    backend: pool
"""
    gw = start_gateway(tmp_path, body)
    sims[0].knobs(healthy=False)

    def status() -> int:  # a quick blocking call to the gateway process
        req = urllib.request.Request(gw.url + "/v1/messages", b"{}", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)

    await until(status, 5, interval=0.1, ok=lambda s: s == 529, what="the member out")
    async with sdks(gw) as (oa, an):
        with pytest.raises(anthropic.OverloadedError) as e:
            await an.messages.create(model="m", max_tokens=1, messages=MESSAGES)
        assert e.value.status_code == 529
        assert e.value.body["error"]["type"] == "overloaded_error"
        assert int(e.value.response.headers["retry-after"]) >= 1
        with pytest.raises(openai.InternalServerError) as o:
            await oa.responses.create(model="m", input="hi")
        assert o.value.status_code == 503
    gw.stop()
