"""Helpers for the LLM-routing tests: the chat bodies they send, the endpoint lists of their
policies."""

from __future__ import annotations

from typing import Any

from tests.integration.backends_support import Sim


def chat(model: str, system: str = "", user: str = "hi", **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    return {"model": model, "messages": messages, "max_tokens": 1, **extra}


def addresses(sims: list[Sim]) -> str:
    return ", ".join(f'{{address: "{s.address}"}}' for s in sims)


def chats(sim: Sim) -> int:
    """Chat completions the simulated backend answered (model listings are not counted)."""
    return int(sim.stats()["requests"].get("POST /v1/chat/completions", 0))


def pool_policy(sims: list[Sim], first_byte_s: float, route: str) -> str:
    """One backend `pool` of `sims`, one route `openai` on /v1/ to it with `route`'s lines."""
    return f"""\
timeouts: {{connect_s: 1, first_byte_s: {first_byte_s}}}
backends:
  - name: pool
    endpoints: [{addresses(sims)}]
routes:
  - name: openai
    match: {{protocol: http, path_prefix: /v1/}}
    backend: pool
{route}"""
