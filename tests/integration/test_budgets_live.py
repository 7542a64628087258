"""Budgets through a live gateway process without a store: reserve at admission, settle to the
backend's usage, refuse with the budget's headers and body, warn, and the operators' commands
(`sluice budget show|grant|reset`) through the admin listener."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.cli import main
from gateway.status.terminal import render
from tests.integration.conftest import Backend, Gateway, start_gateway
from tests.support import free_port

pytestmark = pytest.mark.integration

TAIL = """budgets:
  rules:
    - name: team-30d
      key: [header:x-team]
      tokens: 1000
      period: {rolling: 30d}  # (a day would start over if a run crossed midnight)
      warn_at: [0.5]
"""
PROMPT = "x" * 40  # 10 tokens by the estimate and by the mock backend
BODY = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": PROMPT}]}


def state(gw: Gateway) -> Any:
    with urllib.request.urlopen(f"{gw.admin}/admin/state", timeout=5) as r:
        return json.loads(r.read())["budgets"]


def budget(capsys: pytest.CaptureFixture[str], gw: Gateway, *args: str) -> dict[str, Any]:
    admin = f"127.0.0.1:{gw.admin_port}"
    assert main(["budget", *args, "--admin", admin, "--json"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


async def chat(s: aiohttp.ClientSession, gw: Gateway, team: str, stream: bool = False) -> Any:
    body = {**BODY, "stream": stream}
    async with s.post(f"{gw.http}/v1/chat/completions", json=body,
                      headers={"x-team": team}) as r:  # fmt: skip
        if stream:
            text = await r.text()
            return r.status, r.headers, text
        return r.status, r.headers, await r.json(content_type=None)


async def test_reserve_settle_refuse_warn_and_operate(
    backend: Backend, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gw = start_gateway(backend, tmp_path, tail=TAIL)
    try:
        used = 0
        answers = []
        async with aiohttp.ClientSession() as s:
            for _ in range(60):
                status, headers, doc = await chat(s, gw, "red")
                answers.append((status, headers, doc))
                if status == 200:
                    u = doc["usage"]
                    used += u["prompt_tokens"] + u["completion_tokens"]
            ok = [a for a in answers if a[0] == 200]
            refused = [a for a in answers if a[0] == 429]
            assert len(ok) + len(refused) == 60 and refused, [a[0] for a in answers]
            # Each asks 10 + 16 = 26 tokens: the last one fits only if 26 tokens remain.
            assert used <= 1000 and 1000 - used < 26, used
            _, headers, doc = refused[0]
            assert headers["x-sluice-budget"] == "team-30d"
            assert headers["x-sluice-budget-remaining"] == str(1000 - used)
            assert headers["x-sluice-budget-reset"].endswith("T00:00:00Z")
            assert int(headers["Retry-After"]) >= 1
            assert doc["error"]["type"] == "budget_exceeded"
            assert doc["error"]["budget"] == "team-30d"
            assert doc["error"]["remaining_tokens"] == 1000 - used
            # The warning header from the half-way mark on, not before.
            warned = ["x-sluice-budget-warning" in h for st, h, _ in answers if st == 200]
            assert warned[0] is False and warned[-1] is True
            assert ok[-1][1]["x-sluice-budget-warning"] == "team-30d=0.5"
            # An Anthropic Messages request gets the refusal in its own dialect.
            async with s.post(f"{gw.http}/v1/messages", json=BODY,
                              headers={"x-team": "red"}) as r:  # fmt: skip
                assert r.status == 429 and r.headers["x-sluice-budget"] == "team-30d"
                doc = await r.json(content_type=None)
            assert doc["type"] == "error" and doc["error"]["type"] == "rate_limit_error"
            assert "token budget team-30d exhausted" in doc["error"]["message"]
            # Another key has its own budget; a stream settles from its usage chunk.
            status, _, text = await chat(s, gw, "blue", stream=True)
            assert status == 200 and "[DONE]" in text and "prompt_tokens" not in text

            shown = budget(capsys, gw, "show", "team-30d", "red")
            assert shown["limit"] == 1000 and shown["used"] == used
            assert shown["reserved"] == 0 and shown["remaining"] == 1000 - used
            assert set(shown) == {"rule", "key", "limit", "used", "reserved", "remaining",
                                  "resets_at"}  # fmt: skip
            blue = budget(capsys, gw, "show", "team-30d", "blue")
            assert blue["used"] == 26

            granted = budget(capsys, gw, "grant", "team-30d", "red", "100")
            assert granted["limit"] == 1100 and granted["remaining"] == 1100 - used
            status, _, _ = await chat(s, gw, "red")
            assert status == 200
            reset = budget(capsys, gw, "reset", "team-30d", "red")
            assert reset["used"] == 0 and reset["remaining"] == 1000
            status, _, _ = await chat(s, gw, "red")
            assert status == 200

        with urllib.request.urlopen(f"{gw.admin}/admin/state", timeout=5) as r:
            page = render(json.loads(r.read()))  # what `sluice status` prints: budgets too
        assert "budgets" in page and "team-30d" in page
        st = state(gw)
        (rule,) = st["rules"]
        assert st["store"] == "memory" and rule["name"] == "team-30d"
        keys = {k["key"]: k for k in rule["recent_keys"]}
        assert keys["red"]["used"] == 26 and keys["red"]["resets_at"].endswith("T00:00:00Z")
        assert rule["counts"]["exhausted"] == len(refused) + 1  # and the Messages request
        assert main(["budget", "show", "nope", "red", "--admin", f"127.0.0.1:{gw.admin_port}"]) == 1
        assert "no budget named 'nope'" in capsys.readouterr().err
    finally:
        assert gw.proc.stop() == 0, gw.proc.output()
    out = gw.proc.output()
    assert "budget grant: rule=team-30d key=red tokens=100" in out
    assert "budget reset: rule=team-30d key=red" in out
    assert "budget team-30d: key red passed 50% of 1000 tokens" in out
    assert '"budget_warning":"team-30d=0.5"' in out


@pytest.mark.parametrize("mode", ["open", "closed"])
async def test_store_unreachable(backend: Backend, tmp_path: Path, mode: str) -> None:
    """A store that never answers: `open` admits and tallies locally, `closed` refuses with
    503 what the local share cannot cover (here: everything, it never leased one)."""
    tail = f"""store: {{redis: {{url: "redis://127.0.0.1:{free_port()}/0", deadline_ms: 50}}}}
budgets:
  rules:
    - name: team-30d
      key: [header:x-team]
      tokens: 1000
      period: {{rolling: 30d}}
      when_store_down: {mode}
"""
    gw = start_gateway(backend, tmp_path, tail=tail)
    try:
        async with aiohttp.ClientSession() as s:
            status, headers, doc = await chat(s, gw, "red")
        if mode == "open":
            assert status == 200 and doc["usage"]["completion_tokens"] == 16
        else:
            assert status == 503 and doc["error"]["type"] == "budget_unavailable"
            assert headers["x-sluice-budget"] == "team-30d" and headers["Retry-After"] == "1"
        assert state(gw)["store_up"] is False
    finally:
        assert gw.proc.stop() == 0, gw.proc.output()
