"""LLM-aware routing with real simulated backends and real clients (httpx, the openai SDK):
routes by the body's model (globs), by_model backends from static names and discovery, the
OpenAI-style 404 for a model nobody serves, and GET /v1/models through Sluice."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.backends_support import Sim, Spawn, start_gateway
from tests.integration.llm_support import addresses, chat

pytestmark = pytest.mark.integration


def two_families(spawn: Spawn) -> tuple[str, list[Sim]]:
    """Three members: llama (two, names), qwen (one, names); a pinned route by glob first."""
    sims = spawn(3, "--ttft-ms", "1", "--completion-tokens", "1")
    body = f"""\
backends:
  - name: llama
    endpoints: [{addresses(sims[:2])}]
    models: {{names: [llama-3-8b, "meta-llama/Llama-3.1-8B"]}}
  - name: qwen
    endpoints: [{addresses(sims[2:])}]
    models: {{names: [qwen-7b, "Qwen/Qwen2.5-7B-Instruct"]}}
  - name: other
    endpoints: [{addresses(sims[2:])}]
routes:
  - name: pinned
    match: {{protocol: http, path_prefix: /v1/, model: ["pinned-*"]}}
    backend: other
  - name: openai
    match: {{protocol: http, path_prefix: /v1/}}
    backends: [{{backend: llama}}, {{backend: qwen}}]
    by_model: true
"""
    return body, sims


async def test_the_body_model_picks_the_backend_and_unknown_models_get_404(
    tmp_path: Path, spawn: Spawn
) -> None:
    body, sims = two_families(spawn)
    gw = start_gateway(tmp_path, body)
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        for _ in range(6):
            r = await c.post("/v1/chat/completions", json=chat("qwen-7b"))
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "qwen-7b"
            assert 0 <= float(r.headers["x-sluice-overhead-ms"]) < 1000
        async with c.stream(
            "POST", "/v1/chat/completions", json=chat("qwen-7b", stream=True)
        ) as st:
            assert st.status_code == 200 and "x-sluice-overhead-ms" in st.headers
            assert b"[DONE]" in b"".join([x async for x in st.aiter_bytes()])
        assert [s.served() for s in sims] == [0, 0, 7]
        for _ in range(6):
            r = await c.post("/v1/chat/completions", json=chat("meta-llama/Llama-3.1-8B"))
            assert r.status_code == 200, r.text
        assert sims[0].served() + sims[1].served() == 6 and sims[2].served() == 7
        r = await c.post("/v1/chat/completions", json=chat("pinned-x"))  # the glob route
        assert r.status_code == 200 and gw.backends()["routes"]
        assert sims[2].served() == 8
        r = await c.post("/v1/chat/completions", json=chat("gpt-4o"))
        assert 0 <= float(r.headers["x-sluice-overhead-ms"]) < 1000  # Sluice's own answer too
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "model_not_found"
        assert "gpt-4o" in err["message"]
        assert sum(s.served() for s in sims) == 14  # no backend saw the unknown model
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    listed = sorted(m.id for m in (await client.models.list()).data)
    assert listed == sorted(
        ["llama-3-8b", "meta-llama/Llama-3.1-8B", "qwen-7b", "Qwen/Qwen2.5-7B-Instruct"]
    )
    with pytest.raises(openai.NotFoundError) as e:
        await client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}]
        )
    assert e.value.code == "model_not_found"
    got = await client.chat.completions.create(
        model="qwen-7b", messages=[{"role": "user", "content": "x"}], max_tokens=1
    )
    assert got.model == "qwen-7b"
    await client.close()
    assert 'sluice_overhead_seconds_count{protocol="http",route="openai"}' in gw.metrics()
    gw.stop()


async def test_requests_without_a_json_body_keep_path_routing(tmp_path: Path, spawn: Spawn) -> None:
    body, sims = two_families(spawn)
    gw = start_gateway(tmp_path, body)
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        r = await c.post("/v1/chat/completions", content=b"not json",
                         headers={"content-type": "text/plain"})  # fmt: skip
        assert r.status_code == 400  # the backend's answer: routed on the path, as before
        assert sum(s.served() for s in sims) == 1
        r = await c.get("/healthz")  # no route matches: Sluice's 404
        assert r.status_code == 404 and r.json()["error"]["type"] == "no_route"
    gw.stop()
