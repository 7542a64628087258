"""The LLM-routing issue's policy validates and compiles as written; its mistakes point at their
line and column; `match.model` globs are compiled once and match as globs."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.core.request import RequestInfo, Wire
from gateway.policy.compiled import compile_policy
from gateway.policy.loader import load_policy
from tests.policy.test_backends_policy import load
from tests.support import ROOT

EXAMPLE = ROOT / "policies" / "examples" / "llm-routing.yaml"


def test_the_issue_policy_validates_and_compiles() -> None:
    c = compile_policy(load_policy(EXAMPLE))
    pinned, openai = c.routes
    assert c.body_routing and pinned.needs_body and openai.needs_body
    assert openai.by_model and (openai.prefix_bytes, openai.load_factor) == (2048, 1.25)
    assert openai.retries is not None and openai.retries.before_first_token
    llama, qwen = c.policy.backends
    assert llama.models is not None and llama.models.discover and llama.models.interval_s == 30
    assert qwen.models is not None and qwen.models.names == ["qwen-7b", "Qwen/Qwen2.5-7B-Instruct"]
    info = RequestInfo(Wire.HTTP, "POST", "/v1/chat/completions", {})
    for model, route in [
        ("llama-3-8b", "llama-pinned"),
        ("meta-llama/Llama-3.1-8B", "llama-pinned"),
        ("Llama-3", "openai"),  # globs are case-sensitive
        ("qwen-7b", "openai"),
        (None, "openai"),  # no model: never the model route
    ]:
        got = c.match(info, model)
        assert got is not None and got.name == route, model
    assert c.match_head(info) is pinned  # the head alone: decided after the body


@pytest.mark.parametrize(
    ("snippet", "error"),
    [
        ("    models: {}\n",
         "5:13: backends[0].models: list `names`, or set `discover: true`"),
        ("    models: {discover: true, interval_s: 0}\n",
         "5:42: backends[0].models.interval_s: Input should be greater"),
        ("    models: {names: ['has space']}\n",
         "5:22: backends[0].models.names[0]: String should match"),
        ("    models: {names: [a], lora: maybe}\n",
         "5:32: backends[0].models.lora: Input should be 'loaded'"),
        ("    protocol: grpc\n    models: {discover: true}\n",
         "6:24: backends[0].models.discover: models are discovered on http"),
    ],
)  # fmt: skip
def test_backend_models_mistakes_point_at_their_field(
    tmp_path: Path, snippet: str, error: str
) -> None:
    text = f"""\
backends:
  - name: b
    endpoints: [{{address: "127.0.0.1:1"}}]
    # models
{snippet}routes:
  - {{name: r, backend: b}}
"""
    errors = load(tmp_path, text)
    assert errors and errors[0].startswith(error), errors


@pytest.mark.parametrize(
    ("route", "error"),
    [
        (
            "affinity: {prefix: {bytes: 8}}",
            "7:32: routes[0].affinity.prefix.bytes: Input should be greater",
        ),
        (
            "affinity: {prefix: {load_factor: 0.9}}",
            "7:38: routes[0].affinity.prefix.load_factor: Input should",
        ),
        (
            "match: {model: ['']}",
            "7:21: routes[0].match.model[0]: String should have at least",
        ),
        ("by_model: yes please", "7:15: routes[0].by_model"),
        (
            "retries: {before_first_token: 3}",
            "7:35: routes[0].retries.before_first_token: Input should be",
        ),
    ],
)
def test_route_mistakes_point_at_their_field(tmp_path: Path, route: str, error: str) -> None:
    text = f"""\
backends:
  - name: b
    endpoints: [{{address: "127.0.0.1:1"}}]
routes:
  - name: r
    backend: b
    {route}
"""
    errors = load(tmp_path, text)
    assert errors and errors[0].startswith(error), errors


def test_a_model_route_asks_for_the_auth_of_the_routes_it_shadows(tmp_path: Path) -> None:
    text = """\
backends:
  - name: b
    endpoints: [{address: "127.0.0.1:1"}]
routes:
  - name: pinned
    match: {path_prefix: /v1/, model: ["llama-*"]}
    backend: b
    auth: off
  - name: other
    match: {path_prefix: /v2/}
    backend: b
  - name: openai
    match: {path_prefix: /}
    backend: b
"""
    errors = load(tmp_path, text)
    assert len(errors) == 1 and errors[0].startswith("8:11: routes[0].auth: route 'pinned'")
    assert "route 'openai'" in errors[0]
    assert load(tmp_path, text.replace("    auth: off\n", "")) == []
