"""Model discovery with real simulated backends: each member's /v1/models read on a timer and
when its health changes, a model list changing at run time, LoRA adapters routed to the
members that have them loaded (or, loading on demand, to their parent's members), and GET
/v1/models through Sluice listing what was discovered."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.integration.backends_support import Gw, Spawn, rewrite, start_gateway
from tests.integration.llm_support import addresses, chat, chats
from tests.support import until

pytestmark = pytest.mark.integration


def discovered(gw: Gw, backend: str) -> dict[str, list[str]]:
    state = gw.backends()["backends"][backend]["models"]["members"]
    return {a: sorted(m["models"]) + sorted(m["adapters"]) for a, m in state.items()}


async def served_by(c: httpx.AsyncClient, model: str, n: int) -> int:
    ok = 0
    for _ in range(n):
        r = await c.post("/v1/chat/completions", json=chat(model))
        ok += r.status_code == 200
    return ok


async def test_a_model_list_changing_at_run_time_moves_the_traffic(
    tmp_path: Path, spawn: Spawn
) -> None:
    a, b = spawn(2, "--ttft-ms", "1", "--completion-tokens", "1", "--models", "llama-3-8b")
    a.knobs(adapters={"sql-lora": "llama-3-8b"})
    gw = start_gateway(
        tmp_path,
        f"""\
backends:
  - name: llama
    endpoints: [{addresses([a, b])}]
    models: {{discover: true, interval_s: 0.2}}
routes:
  - name: openai
    match: {{protocol: http, path_prefix: /v1/}}
    backend: llama
    by_model: true
""",
    )
    await until(lambda: len(discovered(gw, "llama")) == 2 and all(discovered(gw, "llama").values()))
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        assert await served_by(c, "sql-lora", 6) == 6  # the adapter: only where it is loaded
        assert (chats(a), chats(b)) == (6, 0)
        assert await served_by(c, "llama-3-8b", 20) == 20
        assert chats(b) > 0
        r = await c.post("/v1/chat/completions", json=chat("llama-3-70b"))
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        listed = (await c.get("/v1/models")).json()["data"]
        assert {m["id"]: m.get("parent") for m in listed} == {
            "llama-3-8b": None, "sql-lora": "llama-3-8b",
        }  # fmt: skip
        b.knobs(models=["llama-3-70b"])  # b now serves another model
        await until(lambda: discovered(gw, "llama")[b.address] == ["llama-3-70b"])
        a.reset()
        b.reset()
        assert await served_by(c, "llama-3-70b", 5) == 5
        assert await served_by(c, "llama-3-8b", 5) == 5
        assert (chats(a), chats(b)) == (5, 5)
    gw.stop()


async def test_a_health_change_lists_the_models_again(tmp_path: Path, spawn: Spawn) -> None:
    (a,) = spawn(1, "--ttft-ms", "1", "--completion-tokens", "1", "--models", "old-model")
    gw = start_gateway(
        tmp_path,
        f"""\
backends:
  - name: pool
    endpoints: [{addresses([a])}]
    models: {{discover: true, interval_s: 3600}}
    health: {{path: /healthz, interval_s: 0.2, unhealthy_after: 1, healthy_after: 1}}
routes:
  - name: openai
    match: {{protocol: http, path_prefix: /v1/}}
    backend: pool
    by_model: true
""",
    )
    await until(lambda: discovered(gw, "pool")[a.address] == ["old-model"])
    a.knobs(healthy=False)
    await until(lambda: gw.member("pool", a.address)["health"]["healthy"] is False)
    a.knobs(models=["new-model"], healthy=True)  # restarted with another model
    await until(lambda: discovered(gw, "pool")[a.address] == ["new-model"])
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        assert await served_by(c, "new-model", 2) == 2
    gw.stop()


async def test_adapters_load_on_demand_on_the_parents_members(tmp_path: Path, spawn: Spawn) -> None:
    a, b = spawn(2, "--ttft-ms", "1", "--completion-tokens", "1", "--models", "llama-3-8b")
    a.knobs(adapters={"sql-lora": "llama-3-8b"}, load_adapters=True)
    b.knobs(load_adapters=True)
    body = f"""\
backends:
  - name: llama
    endpoints: [{addresses([a, b])}]
    models: {{discover: true, interval_s: 0.2, lora: LORA}}
routes:
  - name: openai
    match: {{protocol: http, path_prefix: /v1/}}
    backend: llama
    by_model: true
"""
    gw = start_gateway(tmp_path, body.replace("LORA", "load_on_demand"))
    await until(lambda: discovered(gw, "llama").get(a.address) == ["llama-3-8b", "sql-lora"])
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        assert await served_by(c, "sql-lora", 4) == 4
        assert (chats(a), chats(b)) == (4, 0)  # loaded on a: it goes there
        a.knobs(adapters={})  # a unloads it: nobody has it now
        await until(lambda: discovered(gw, "llama")[a.address] == ["llama-3-8b"])
        assert await served_by(c, "sql-lora", 10) == 10  # to the parent's members, loaded there
        assert chats(a) + chats(b) == 14
        r = await c.post("/v1/chat/completions", json=chat("never-seen-lora"))
        assert r.status_code == 404  # an adapter whose parent nobody listed
    gw.stop()
    a.knobs(adapters={"sql-lora": "llama-3-8b"})
    b.knobs(adapters={})
    gw = start_gateway(tmp_path, body.replace("LORA", "loaded"))  # the default: no loading
    await until(lambda: discovered(gw, "llama").get(a.address) == ["llama-3-8b", "sql-lora"])
    a.knobs(adapters={})
    await until(lambda: discovered(gw, "llama")[a.address] == ["llama-3-8b"])
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        r = await c.post("/v1/chat/completions", json=chat("sql-lora"))
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    gw.stop()


async def test_a_reload_keeps_what_was_discovered(tmp_path: Path, spawn: Spawn) -> None:
    (a,) = spawn(1, "--ttft-ms", "1", "--completion-tokens", "1", "--models", "llama-3-8b")
    body = f"""\
backends:
  - name: llama
    endpoints: [{addresses([a])}]
    models: {{discover: true, interval_s: 3600}}
routes:
  - name: openai
    match: {{protocol: http, path_prefix: /v1/}}
    backend: llama
    by_model: true
"""
    gw = start_gateway(tmp_path, body)
    await until(lambda: discovered(gw, "llama").get(a.address) == ["llama-3-8b"])
    before = gw.version()
    rewrite(gw, body.replace("name: openai", "name: openai2"))  # a reload, same backend section
    await until(lambda: gw.version() != before)
    state = gw.backends()["backends"]["llama"]["models"]["members"][a.address]
    assert state["models"] == ["llama-3-8b"] and state["reads"] == 1  # kept, not listed again
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        assert await served_by(c, "llama-3-8b", 2) == 2
    gw.stop()
