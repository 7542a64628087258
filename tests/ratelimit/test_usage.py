"""Token accounting through the real forwarding path, in process: a Gateway with a
`rate_limits` policy, both HTTP engines and the gRPC listener on port 0, the simulated backend.
The bucket ends where the backend's reported usage says, streaming or not."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from gateway.adapters.engines import start_grpc, start_http
from gateway.app import Gateway
from gateway.mockbackend import Knobs, start_mock_backend
from gateway.proto import load
from gateway.ratelimit.owner import RATELIMIT

BURST = 100_000

POLICY = """
version: 1
listeners: {{http: null, grpc: null, admin: null}}
access_log: {{enabled: false}}
backends:
  - name: sim
    endpoints: [{{address: "127.0.0.1:{http}"}}]
  - name: sim-grpc
    protocol: grpc
    endpoints: [{{address: "127.0.0.1:{grpc}"}}]
    unary_methods: [/sluice.inference.v1.Inference/Infer]
routes:
  - name: grpc
    match: {{protocol: grpc}}
    backend: sim-grpc
  - name: http
    match: {{protocol: http}}
    backend: sim
rate_limits:
  default_max_tokens: {default_max}
  grpc_usage_trailer: x-mock-usage-tokens
  rules:
    - name: tok
      key: [header:x-tenant]
      tokens_per_second: 0.001
      burst_tokens: {burst}
      on_overrun: {on_overrun}
{extra}"""


@contextlib.asynccontextmanager
async def rig(
    tmp_path: Path, engine: str, on_overrun: str = "allow", default_max: int = 64, extra: str = ""
) -> AsyncIterator[tuple[Gateway, aiohttp.ClientSession, int]]:
    mock = await start_mock_backend(
        "127.0.0.1:0", "127.0.0.1:0", Knobs(ttft_ms=1, token_delay_ms=1, completion_tokens=12)
    )
    p = tmp_path / "policy.yaml"
    p.write_text(
        POLICY.format(
            http=mock.http_port,
            grpc=mock.grpc_port,
            burst=BURST,
            on_overrun=on_overrun,
            default_max=default_max,
            extra=extra,
        )  # fmt: skip
    )
    gw = Gateway(p)
    http = await start_http(gw, "127.0.0.1", 0, engine=engine)
    g = await start_grpc(gw, "127.0.0.1", 0)
    session = aiohttp.ClientSession(f"http://127.0.0.1:{http.port}")
    try:
        yield gw, session, g.port
    finally:
        await session.close()
        await http.close(1.0)
        await g.stop(1.0)
        await gw.aclose()
        await mock.close()


def tokens_left(gw: Gateway, tenant: str) -> float:
    lim = gw.services.peek(RATELIMIT)
    (rs,) = lim.rules.values()
    return rs.keys[tenant].bucket.tokens


CHAT = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hello " * 20}]}


@pytest.mark.parametrize("engine", ["aiohttp", "native"])
async def test_json_usage_settles_the_bucket(tmp_path: Path, engine: str) -> None:
    async with rig(tmp_path, engine) as (gw, s, _):
        async with s.post("/v1/chat/completions", json=CHAT, headers={"x-tenant": "a"}) as r:
            assert r.status == 200
            usage = (await r.json())["usage"]
        assert tokens_left(gw, "a") == pytest.approx(BURST - usage["total_tokens"], abs=1)


@pytest.mark.parametrize("engine", ["aiohttp", "native"])
async def test_stream_usage_is_asked_for_hidden_and_settles(tmp_path: Path, engine: str) -> None:
    async with rig(tmp_path, engine) as (gw, s, _):
        body = {**CHAT, "stream": True}
        async with s.post("/v1/chat/completions", json=body, headers={"x-tenant": "b"}) as r:
            text = await r.text()
        events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        docs = [json.loads(e) for e in events[:-1]]
        assert not any(d.get("usage") for d in docs)  # the client did not ask: hidden
        # Ask for it explicitly: the numbers the client sees are the ones charged.
        body["stream_options"] = {"include_usage": True}
        async with s.post("/v1/chat/completions", json=body, headers={"x-tenant": "c"}) as r:
            text = await r.text()
        docs = [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: {")]
        usage = next(d["usage"] for d in docs if d.get("usage"))
        assert tokens_left(gw, "c") == pytest.approx(BURST - usage["total_tokens"], abs=1)
        assert tokens_left(gw, "b") == pytest.approx(BURST - usage["total_tokens"], abs=1)


@pytest.mark.parametrize("engine", ["aiohttp", "native"])
async def test_overrunning_stream_is_cut_cleanly(tmp_path: Path, engine: str) -> None:
    async with rig(tmp_path, engine, on_overrun="cut", default_max=4) as (gw, s, _):
        body: dict[str, Any] = {"model": "m", "stream": True, "messages": []}  # no max_tokens
        async with s.post("/v1/chat/completions", json=body, headers={"x-tenant": "d"}) as r:
            assert r.status == 200
            text = await r.text()
        events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])
        assert err["error"]["type"] == "token_overrun"
        content = [e for e in events[:-2] if '"content"' in e]
        assert len(content) == 4  # reserved 4 completion tokens: the 5th is not sent
        lim = gw.services.peek(RATELIMIT)
        (rs,) = lim.rules.values()
        assert rs.counts[10] == 1  # token_cut


async def test_grpc_trailer_usage_settles_the_bucket(tmp_path: Path) -> None:
    pb2, pb2_grpc = load()
    async with rig(tmp_path, "native", default_max=500) as (gw, _, port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = pb2_grpc.InferenceStub(ch).Infer(
                pb2.InferRequest(model="m", prompt="hi there"),
                metadata=(("x-tenant", "g"),),
                timeout=10,
            )
            await call
            trailers = dict(await call.trailing_metadata())
        used = int(trailers["x-mock-usage-tokens"])
        assert used > 0
        assert tokens_left(gw, "g") == pytest.approx(BURST - used, abs=1)


BURST_RULE = """    - name: burst
      key: [header:x-burst]
      qps: 0.2
      window_s: 10
"""


@pytest.mark.parametrize("engine", ["aiohttp", "native"])
async def test_http_refusal_carries_retry_after_and_ratelimit_headers(
    tmp_path: Path, engine: str
) -> None:
    async with rig(tmp_path, engine, extra=BURST_RULE) as (_, s, _):
        statuses = []
        for _ in range(4):
            async with s.get("/v1/models", headers={"x-burst": "k"}) as r:
                statuses.append(r.status)
                body = await r.read()
                headers = r.headers
        assert statuses.count(200) == 2 and statuses[-1] == 429
        assert json.loads(body)["error"]["type"] == "rate_limited"
        assert int(headers["Retry-After"]) >= 1
        assert headers["x-ratelimit-limit-requests"] == "2"  # 0.2/s over a 10 s window
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert headers["x-ratelimit-reset-requests"].endswith("s")


async def test_grpc_refusal_is_resource_exhausted_with_the_same_metadata(tmp_path: Path) -> None:
    pb2, pb2_grpc = load()
    async with rig(tmp_path, "native", extra=BURST_RULE) as (_, _, port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb2_grpc.InferenceStub(ch)
            codes = []
            for _ in range(4):
                call = stub.Infer(
                    pb2.InferRequest(model="m", prompt="hi"),
                    metadata=(("x-burst", "g"), ("x-tenant", "g")),
                    timeout=10,
                )
                try:
                    await call
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
                    trailers = dict(e.trailing_metadata() or ())
        assert codes.count(grpc.StatusCode.OK) == 2
        assert codes[-1] is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert trailers["x-ratelimit-limit-requests"] == "2"
        assert "retry-after" in trailers and "x-ratelimit-reset-requests" in trailers
