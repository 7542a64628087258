"""The policies `sluice bench --full` runs are valid Sluice policies, each feature really off in
its leave-one-out row, and the token the full chain sends is accepted by its auth section."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.bench.full import FEATURES, prepare, with_full_chain
from gateway.bench.gateways import Variant, policy_doc
from gateway.bench.loads import CHAT_PATH
from gateway.bench.procs import CHAT_JSON, nginx_conf
from gateway.filters.registry import build_chain
from gateway.policy.compiled import compile_policy
from gateway.policy.model import Policy
from gateway.services import Services

PORTS = {"http": 18080, "grpc": 18081, "admin": 18082}


def full_doc(tmp_path: Path, without: str | None) -> dict:  # type: ignore[type-arg]
    base = policy_doc(PORTS, 18090, None, True, Variant("native", full=True, without=without))
    return with_full_chain(base, prepare(tmp_path), without)


def test_the_full_chain_policy_has_every_feature(tmp_path: Path) -> None:
    doc = full_doc(tmp_path, None)
    compiled = compile_policy(Policy.model_validate(doc))
    route = next(r for r in compiled.routes if r.name == "http")
    assert route.retries is not None
    chain = build_chain(compiled, Services())
    built = [f.name for f in chain.filters]
    assert {"request_id", "trace", "auth", "ratelimit", "budget", "route"} <= set(built)
    assert chain.has_body and chain.has_events  # the token rule reserves and reconciles


@pytest.mark.parametrize("without", FEATURES)
def test_each_leave_one_out_policy_lacks_only_its_feature(tmp_path: Path, without: str) -> None:
    doc = full_doc(tmp_path, without)
    Policy.model_validate(doc)
    present = {
        "auth": "auth" in doc,
        "rate_limits": "rate_limits" in doc,
        "budgets": "budgets" in doc,
        "tracing": "tracing" in doc,
        "resilience": "breaker" in doc["backends"][0],
    }
    assert [f for f, on in present.items() if not on] == [without]


def test_the_full_chain_token_verifies_with_its_secret(tmp_path: Path) -> None:
    import jwt

    files = prepare(tmp_path)
    claims = jwt.decode(
        files.token, files.secret_file.read_text(), algorithms=["HS256"], audience="sluice"
    )
    assert claims["tenant"] == "t1"
    assert files.wrk_headers == ["-H", f"Authorization: Bearer {files.token}"]


def test_the_bench_backend_answers_the_chat_post_with_usage(tmp_path: Path) -> None:
    conf = nginx_conf(tmp_path, 18099, None)
    assert f"location {CHAT_PATH}" in conf and CHAT_JSON in conf
    assert '"usage"' in CHAT_JSON
