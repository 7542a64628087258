"""The route filter over the backends owner, with a manual clock: breakers take members out
and let them back, retries go elsewhere within budget, the canary guard sets the canary's
weight to 0, stickiness, priority failover, and what a reload keeps."""

from __future__ import annotations

import gc
import random
from collections import Counter
from typing import Any

import pytest

from gateway.context import RequestContext, Status
from gateway.core.breaker import State
from gateway.core.clock import ManualClock
from gateway.core.outcome import Outcome
from gateway.core.request import RequestInfo, Wire
from gateway.filters.routing import RouteFilter
from gateway.policy.compiled import Endpoint, compile_policy
from gateway.policy.model import Policy
from gateway.registry.pool import BACKENDS, IDLE_S, BackendPool
from gateway.services import Services

BREAKER = {"consecutive_failures": 3, "min_requests": 10, "open_s": 5, "max_open_s": 20,
           "half_open_probes": 2, "slow_call_s": 1.0}  # fmt: skip


def policy(**route: Any) -> dict[str, Any]:
    return {
        "backends": [
            {"name": "stable", "breaker": BREAKER, "endpoints": [
                {"address": "10.0.0.1:80"}, {"address": "10.0.0.2:80"},
                {"address": "10.0.1.1:80", "priority": 1}]},
            {"name": "canary", "endpoints": [{"address": "10.0.0.9:80"}]},
        ],
        "routes": [
            {"name": "chat", "match": {"path_prefix": "/v1/"},
             "backends": [{"backend": "stable", "weight": 90}, {"backend": "canary", "weight": 10}],
             **route},
            {"name": "solo", "match": {"path_prefix": "/solo"}, "backend": "stable"},
        ],
    }  # fmt: skip


class Rig:
    def __init__(self, doc: dict[str, Any], seed: int = 1) -> None:
        self.clock = ManualClock(100.0)
        self.services = Services(self.clock)
        self.pool = self.services.get(
            BACKENDS, lambda: BackendPool(self.services, random.Random(seed).random)
        )
        self.load(doc)

    def load(self, doc: dict[str, Any]) -> RouteFilter:
        self.policy = compile_policy(Policy.model_validate(doc))
        self.f = RouteFilter(self.policy, self.pool)
        self.f.activate()  # no running loop: background work waits for the first request
        return self.f

    def ctx(self, path: str = "/v1/chat", headers: dict[str, str] | None = None) -> RequestContext:
        info = RequestInfo(Wire.HTTP, "POST", path, headers or {}, peer="1.2.3.4")
        return RequestContext(info, self.policy)

    def send(
        self,
        path: str = "/v1/chat",
        status: int = 200,
        outcome: Outcome = Outcome.OK,
        ttfb: float = 0.01,
        headers: dict[str, str] | None = None,
    ) -> RequestContext:
        ctx = self.ctx(path, headers)
        assert self.f.on_request(ctx) is Status.CONTINUE, ctx.verdict
        ctx.outcome, ctx.http_status = outcome, status
        ctx.first_byte_at = self.clock.t + ttfb if outcome is Outcome.OK else None
        self.clock.t += ttfb
        self.f.on_response(ctx)
        return ctx

    def member(self, address: str, backend: str = "stable") -> Any:
        return self.pool.latest[backend].members[address]


def test_split_follows_weights_and_in_flight_returns_to_zero() -> None:
    rig = Rig(policy())
    got = Counter(rig.send().endpoint.backend for _ in range(1000))  # type: ignore[union-attr]
    assert got == Counter({"stable": 900, "canary": 100})
    assert all(c.in_flight == 0 for c in rig.pool.cores.values())


def test_failing_member_is_taken_out_then_probed_back() -> None:
    rig = Rig(policy())
    bad = rig.member("10.0.0.1:80")
    for _ in range(200):
        ctx = rig.ctx("/solo")
        rig.f.on_request(ctx)
        assert ctx.endpoint is not None
        fails = ctx.endpoint.address == bad.address
        ctx.outcome = Outcome.UPSTREAM_CONNECT if fails else Outcome.OK
        ctx.http_status = 0 if fails else 200
        rig.f.on_response(ctx)
        if bad.breaker.state is State.OPEN:
            break
    assert bad.breaker.state is State.OPEN
    seen = Counter(rig.send("/solo").endpoint.address for _ in range(50))  # type: ignore[union-attr]
    # 1 of 2 primaries left: the primary keeps 1.4 × 50 % = 70 %, the secondary takes the rest
    assert bad.address not in seen and seen["10.0.0.2:80"] > seen["10.0.1.1:80"] > 0
    rig.clock.t += 6.0  # open time (5 s ± 20 %) is over: half-open, probes first
    probes = [rig.ctx("/solo") for _ in range(3)]
    for c in probes:
        rig.f.on_request(c)
    assert [c.endpoint.address for c in probes[:2]] == [bad.address] * 2  # type: ignore[union-attr]
    assert probes[2].endpoint.address != bad.address  # type: ignore[union-attr]  # bounded
    for c in probes:
        c.outcome, c.http_status, c.first_byte_at = Outcome.OK, 200, rig.clock.t
        rig.f.on_response(c)
    assert bad.breaker.state is State.CLOSED


def test_probe_is_judged_by_its_first_byte_while_the_stream_runs() -> None:
    rig = Rig(policy())
    bad = rig.member("10.0.0.1:80")
    bad.breaker.open_until = 0.0
    bad.breaker.state = State.OPEN
    rig.pool.changed()
    streams = [rig.ctx("/solo") for _ in range(2)]
    for c in streams:
        rig.f.on_request(c)
        assert c.endpoint is not None and c.endpoint.address == bad.address
        c.first_byte_at = rig.clock.t + 0.05  # the first byte went out; the stream goes on
    rig.clock.t += 30.0  # far past probe_timeout_s (= slow_call_s, 1 s)
    rig.send("/solo")  # the next pick looks at the probes: answered in time
    assert bad.breaker.state is State.CLOSED
    for c in streams:  # their ends change nothing more
        c.outcome = Outcome.UPSTREAM_PROTOCOL
        rig.f.on_response(c)
    assert bad.breaker.state is State.CLOSED and bad.core.in_flight == 0


def test_hanging_probe_reopens_the_breaker() -> None:
    rig = Rig(policy())
    bad = rig.member("10.0.0.1:80")
    bad.breaker.state, bad.breaker.open_until = State.OPEN, 0.0
    rig.pool.changed()
    c = rig.ctx("/solo")
    rig.f.on_request(c)
    assert c.endpoint is not None and c.endpoint.address == bad.address
    rig.clock.t += 1.5  # no first byte after the probe timeout
    rig.send("/solo")
    assert bad.breaker.state is State.OPEN and bad.breaker.reopens == 1


def test_all_breakers_open_answers_503() -> None:
    rig = Rig(policy())
    for m in rig.pool.latest["stable"].members.values():
        m.breaker.state, m.breaker.open_until = State.OPEN, rig.clock.t + 10
    rig.pool.changed()
    ctx = rig.ctx("/solo")
    assert rig.f.on_request(ctx) is Status.STOP
    assert ctx.verdict.http_status == 503 and ctx.verdict.error_type == "no_healthy_upstream"
    # the split route sends everything to the canary meanwhile
    got = Counter(rig.send().endpoint.backend for _ in range(20))  # type: ignore[union-attr]
    assert got == Counter({"canary": 20})


def test_priority_failover_to_secondary() -> None:
    rig = Rig(policy())
    for a in ("10.0.0.1:80", "10.0.0.2:80"):
        m = rig.member(a)
        m.breaker.state, m.breaker.open_until = State.OPEN, rig.clock.t + 10
    rig.pool.changed()
    got = Counter(rig.send("/solo").endpoint.address for _ in range(20))  # type: ignore[union-attr]
    assert got == Counter({"10.0.1.1:80": 20})


def next_try(ctx: RequestContext) -> Endpoint | None:
    """What the forwarding path asks after a failed try (`gateway.forward.lifecycle.retry`)."""
    endpoint: Endpoint | None = ctx.upstream_attempt.next_try(ctx)
    return endpoint


def test_retry_goes_to_another_member_and_respects_the_budget() -> None:
    rig = Rig(policy(retries={"attempts": 3, "budget_ratio": 0.2, "min_retries": 1}))
    ctx = rig.ctx()
    rig.f.on_request(ctx)
    first = ctx.endpoint
    assert first is not None
    ctx.outcome = Outcome.UPSTREAM_CONNECT
    second = next_try(ctx)
    assert second is not None and second.address != first.address
    assert ctx.outcome is Outcome.OK  # reset for the next try
    budget = rig.f.pickers["chat"].budget
    assert budget is not None and budget.retrying == 1
    # a second request's retry finds the budget (1 in flight) used up
    other = rig.ctx()
    rig.f.on_request(other)
    other.outcome = Outcome.UPSTREAM_CONNECT
    assert next_try(other) is None and budget.refused == 1
    # a failed try after a byte reached the client is never retried
    ctx.outcome, ctx.http_status, ctx.first_byte_at = Outcome.OK, 503, rig.clock.t
    assert next_try(ctx) is None
    for c in (ctx, other):
        rig.f.on_response(c)
    assert budget.retrying == 0 and budget.active == 0
    assert all(c.in_flight == 0 for c in rig.pool.cores.values())


def test_retries_stop_at_attempts_and_skip_tried_members() -> None:
    rig = Rig(policy(retries={"attempts": 5, "min_retries": 10}))
    ctx = rig.ctx("/v1/x")
    rig.f.on_request(ctx)
    seen = [ctx.endpoint.address]  # type: ignore[union-attr]
    while True:
        ctx.outcome, ctx.http_status = Outcome.OK, 503
        nxt = next_try(ctx)
        if nxt is None:
            break
        seen.append(nxt.address)
    assert len(seen) == len(set(seen)) and len(seen) <= 5
    rig.f.on_response(ctx)


def test_canary_guard_sets_canary_weight_to_zero_until_the_policy_changes() -> None:
    doc = policy(canary={"backend": "canary", "min_requests": 10, "max_error_ratio": 0.02,
                         "override_header": "x-sluice-canary"})  # fmt: skip
    rig = Rig(doc)
    for _ in range(400):
        ctx = rig.ctx()
        rig.f.on_request(ctx)
        assert ctx.endpoint is not None
        ctx.http_status = 500 if ctx.endpoint.backend == "canary" else 200
        ctx.first_byte_at = rig.clock.t + 0.01
        rig.clock.t += 0.01
        rig.f.on_response(ctx)
    guard = rig.f.pickers["chat"].guard
    assert guard is not None and guard.tripped
    got = Counter(rig.send().endpoint.backend for _ in range(200))  # type: ignore[union-attr]
    assert got == Counter({"stable": 200})
    # the override header still reaches it (an explicit opt-in)
    c = rig.send(headers={"x-sluice-canary": "1"})
    assert c.endpoint is not None and c.endpoint.backend == "canary"
    # an unrelated reload keeps the guard; a change to the canary section re-arms it
    other = policy(canary=doc["routes"][0]["canary"])
    other["routes"][1]["name"] = "solo2"
    rig.load(other)
    assert rig.f.pickers["chat"].guard is guard and guard.tripped
    doc["routes"][0]["canary"]["max_error_ratio"] = 0.05
    rig.load(doc)
    assert not rig.f.pickers["chat"].guard.tripped  # type: ignore[union-attr]
    got = Counter(rig.send().endpoint.backend for _ in range(100))  # type: ignore[union-attr]
    assert got["canary"] == 10


def test_override_header_off_and_sticky_users() -> None:
    rig = Rig(policy(canary={"backend": "canary", "override_header": "x-sluice-canary"},
                     sticky={"header": "x-user"}))  # fmt: skip
    off = Counter(rig.send(headers={"x-sluice-canary": "0"}).endpoint.backend  # type: ignore[union-attr]
                  for _ in range(100))  # fmt: skip
    assert off == Counter({"stable": 100})
    where = {}
    for i in range(300):
        ends = {rig.send(headers={"x-user": f"u{i}"}).endpoint for _ in range(3)}  # type: ignore[union-attr]
        assert len(ends) == 1  # the same user, the same member
        where[i] = ends.pop()
    share = sum(1 for e in where.values() if e is not None and e.backend == "canary") / 300
    assert share == pytest.approx(0.1, abs=0.05)


def test_reload_keeps_member_state_unless_its_section_changed() -> None:
    doc = policy()
    rig = Rig(doc)
    m = rig.member("10.0.0.1:80")
    m.breaker.state, m.breaker.open_until = State.OPEN, rig.clock.t + 10
    breaker = m.breaker
    doc["backends"][0]["endpoints"][1]["weight"] = 5  # another member's weight
    doc["backends"][0]["panic_threshold"] = 0.3
    rig.load(doc)
    m = rig.member("10.0.0.1:80")
    assert m.breaker is breaker and m.breaker.state is State.OPEN
    assert rig.member("10.0.0.2:80").weight == 5.0
    doc["backends"][0]["endpoints"].pop(1)  # a member leaves
    rig.load(doc)
    assert "10.0.0.2:80" not in rig.pool.latest["stable"].members
    doc["backends"][0]["breaker"] = {**BREAKER, "open_s": 1, "max_open_s": 2}
    rig.load(doc)
    m = rig.member("10.0.0.1:80")
    assert m.breaker is not breaker and m.breaker.state is State.CLOSED


def test_reloads_that_change_parameters_leave_only_the_live_state() -> None:
    # 50 reloads, each with other breaker numbers, canary guard and retry budget, and the
    # backends renamed (a prefix book per backend name): what the pool keeps follows the
    # policies in use, not every policy since start.
    rig = Rig(policy())
    for i in range(50):
        doc = policy(
            canary={"backend": f"canary{i}", "min_requests": 10 + i},
            retries={"attempts": 2, "budget_ratio": 0.1 + i / 1000, "min_retries": 1},
        )
        doc["backends"][0]["breaker"] = {**BREAKER, "slow_call_s": 1.0 + i}
        for b in doc["backends"]:
            b["name"] += str(i)
        for r in doc["routes"]:
            for t in r.get("backends", []):
                t["backend"] += str(i)
            if "backend" in r:
                r["backend"] += str(i)
        rig.load(doc)
        for _ in range(3):
            rig.send()
    rig.clock.t += IDLE_S + 1
    gc.collect()  # the older filters are gone
    rig.pool.sweep(rig.clock.t)
    pool = rig.pool
    assert set(pool.books) == {"stable49", "canary49"}
    assert len(pool.cores) == 4 and len(pool.boxes) == 3
    assert len(pool.guards) == 1 and len(pool.budgets) == 1
    assert set(pool.views) <= {v.key for v in pool.latest.values()}


def test_grpc_failure_codes() -> None:
    doc = {
        "backends": [{"name": "g", "protocol": "grpc", "breaker": BREAKER,
                      "endpoints": [{"address": "10.0.0.5:81"}, {"address": "10.0.0.6:81"}]}],
        "routes": [{"name": "g", "match": {"protocol": "grpc"}, "backend": "g"}],
    }  # fmt: skip
    rig = Rig(doc)
    for code, bad in [(3, False), (5, False), (14, True)]:
        m = rig.member("10.0.0.5:81", "g")
        m.breaker.state, m.breaker.consecutive = State.CLOSED, 0
        for _ in range(3):
            ctx = RequestContext(RequestInfo(Wire.GRPC, "POST", "/p.S/M", {}, "x"), rig.policy)
            rig.f.on_request(ctx)
            ctx.grpc_status = code
            ctx.outcome = Outcome.UPSTREAM_ERROR
            rig.f.on_response(ctx)
        assert (rig.member("10.0.0.5:81", "g").breaker.consecutive > 0) is bad or (
            rig.member("10.0.0.6:81", "g").breaker.consecutive > 0
        ) is bad
