"""The rate-limit filter's hooks called directly, with a manual clock."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.context import EventKind, Principal, RequestContext, Status, StreamEvent
from gateway.core.body import Usage, from_doc
from gateway.core.clock import ManualClock, MonotonicClock
from gateway.core.lease import IDLE_S
from gateway.core.outcome import Outcome
from gateway.core.request import RequestInfo, Wire
from gateway.filters.chain import Chain
from gateway.filters.ratelimit import RateLimitFilter, TokenRateLimitFilter, build
from gateway.filters.ratelimit_steps import Ticket
from gateway.filters.registry import build_chain
from gateway.policy.compiled import CompiledPolicy, compile_policy
from gateway.policy.model import Policy, reference_errors
from gateway.policy.ratelimits import RedisStoreOptions
from gateway.ratelimit.owner import Limiter
from gateway.ratelimit.sync import sync_once
from gateway.services import Services
from gateway.store.memory import MemoryStore

BASE: dict[str, Any] = {
    "backends": [{"name": "a", "endpoints": [{"address": "127.0.0.1:1"}]}],
    "routes": [{"name": "r", "backend": "a"}],
}


def policy(rate_limits: dict[str, Any] | None, **extra: Any) -> CompiledPolicy:
    doc = {**BASE, **extra}
    if rate_limits is not None:
        doc["rate_limits"] = rate_limits
    return compile_policy(Policy.model_validate(doc))


class Rig:
    def __init__(self, rate_limits: dict[str, Any], clock: Any = None) -> None:
        self.clock = clock if clock is not None else ManualClock(1000.0)
        self.services = Services(self.clock)
        self.load(rate_limits)

    def load(self, rate_limits: dict[str, Any]) -> None:
        self.policy = policy(rate_limits)
        self.chain: Chain = build_chain(self.policy, self.services)
        self.filter: Any = next(f for f in self.chain.filters if f.name == "ratelimit")
        self.lim: Limiter = self.filter.lim
        self.lim.compiled = self.filter.c  # activate() without the background loop
        for ident in [i for i in self.lim.rules if i not in {r.ident for r in self.filter.c.rules}]:
            del self.lim.rules[ident]

    def ctx(
        self,
        headers: dict[str, str] | None = None,
        claims: dict[str, Any] | None = None,
        protocol: Wire = Wire.HTTP,
        peer: str = "10.0.0.1",
    ) -> RequestContext:
        path = "/pkg.S/M" if protocol is Wire.GRPC else "/v1/chat/completions"
        info = RequestInfo(protocol, "POST", path, headers or {}, peer=peer)
        ctx = RequestContext(info, self.policy)
        if claims is not None:
            ctx.principal = Principal("idp", "sub", claims)
        return ctx

    async def request(self, ctx: RequestContext) -> Status:
        return await self.chain.on_request(ctx)

    async def send(self, n: int, dt: float, **kw: Any) -> list[RequestContext]:
        out = []
        for _ in range(n):
            self.clock.t += dt
            ctx = self.ctx(**kw)
            await self.request(ctx)
            await self.chain.on_response(ctx)
            out.append(ctx)
        return out


def statuses(ctxs: list[RequestContext]) -> list[int]:
    return [c.verdict.http_status for c in ctxs]


RULE = {"name": "per-tenant", "key": ["header:x-tenant"], "qps": 10}


def test_build_is_none_without_a_section() -> None:
    s = Services()
    assert build(policy(None), s) is None
    assert build(policy({"rules": []}), s) is None
    assert isinstance(build(policy({"rules": [RULE]}), s), RateLimitFilter)
    f = build(policy({"rules": [{**RULE, "tokens_per_second": 5}]}), s)
    assert isinstance(f, TokenRateLimitFilter)


def test_a_chain_listed_without_ratelimit_is_refused() -> None:
    p = Policy.model_validate(
        {**BASE, "filters": ["request_id", "route"], "rate_limits": {"rules": [RULE]}},
        context={"defer_references": True},
    )
    assert [loc for loc, _ in reference_errors(p)] == [("filters",)]


def test_the_issue_example_validates() -> None:
    rl = {
        "store": {"redis": {"url": "redis://127.0.0.1:6379/0"}},
        "priority": {"from": "claim:tier", "classes": {"gold": 0, "silver": 1, "free": 2},
                     "default": 2},
        "rules": [
            {"name": "per-tenant", "key": ["claim:tenant"], "qps": 50,
             "tokens_per_second": 20000, "burst_tokens": 60000},
            {"name": "per-ip-shadow", "key": ["source_ip"], "qps": 20, "enforce": False},
        ],
    }  # fmt: skip
    p = policy(rl)
    assert p.policy.rate_limits is not None and p.policy.rate_limits.priority is not None
    assert p.policy.rate_limits.priority.source == "claim:tier"
    assert "ratelimit" in p.policy.filters


async def test_qps_limit_refuses_with_retry_after_and_headers() -> None:
    rig = Rig({"rules": [RULE]})
    ctxs = await rig.send(12, 0.001, headers={"x-tenant": "a"})
    assert statuses(ctxs).count(200) == 10
    v = ctxs[-1].verdict
    assert (v.http_status, v.grpc_status, v.error_type) == (429, 8, "rate_limited")
    assert v.retry_after is not None and 0 < v.retry_after <= 2.0  # a window and a bit
    h = dict(v.headers)
    assert h["x-ratelimit-limit-requests"] == "10"
    assert h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-reset-requests"].endswith("s")
    # Another tenant has its own bucket.
    other = await rig.send(1, 0.001, headers={"x-tenant": "b"})
    assert statuses(other) == [200]


async def test_shadow_rule_counts_but_never_refuses() -> None:
    rig = Rig({"rules": [{**RULE, "enforce": False}]})
    ctxs = await rig.send(30, 0.001, headers={"x-tenant": "a"})
    assert set(statuses(ctxs)) == {200}
    rs = next(iter(rig.lim.rules.values()))
    assert rs.counts[0] == 10 and rs.counts[6] == 20  # admit, shadow_reject


PRIO = {"from": "header:x-tier", "classes": {"gold": 0, "silver": 1, "free": 2}, "default": 2}


async def test_yellow_sheds_the_lowest_class_first_and_red_all_but_the_top() -> None:
    rule = {"name": "t", "key": [], "qps": 100, "tokens_per_second": 1e5, "burst_tokens": 1e5}
    rig = Rig({"priority": PRIO, "rules": [rule], "overload": {"yellow_delay_ms": 0}})
    rs = next(iter(rig.lim.rules.values()))
    seen: dict[str, list[int]] = {"gold": [], "silver": [], "free": []}

    async def one(tier: str) -> int:
        rig.clock.t += 0.001
        ctx = rig.ctx(headers={"x-tier": tier})
        if await rig.request(ctx) is Status.CONTINUE:
            rig.filter.on_body(ctx, from_doc(b"{}", {"max_tokens": 20, "messages": []}))
        await rig.chain.on_response(ctx)
        return ctx.verdict.http_status

    for _ in range(34):  # 102 arrivals in ~0.1 s against 100/s: offered > 85 % -> yellow
        for tier in ("gold", "silver", "free"):
            seen[tier].append(await one(tier))
    ks = next(iter(rs.keys.values()))
    assert ks.colour.label == "yellow"
    assert 503 in seen["free"] and 503 not in seen["silver"] and 503 not in seen["gold"]
    ks.bucket.tokens = 100.0  # the token bucket nearly empty too: both signals high -> red
    results = {tier: await one(tier) for tier in ("free", "silver", "gold")}
    assert ks.colour.label == "red"
    assert results["free"] == 503 and results["silver"] == 503
    assert results["gold"] != 503  # the top class is never shed: only its own limits apply
    state = rig.lim.state()
    assert state["rejections"]["shed_yellow"] >= 1
    assert state["rejections"]["shed_red"] == 2
    assert any(t["change"] == "yellow->red" for t in state["transitions"])


async def test_priority_from_a_claim() -> None:
    prio = {"from": "claim:tier", "classes": {"gold": 0, "free": 2}, "default": 2}
    rig = Rig({"priority": prio, "rules": [RULE]})
    ctx = rig.ctx(claims={"tier": "gold"})
    await rig.request(ctx)
    assert ctx.priority == 0
    ctx = rig.ctx(claims={"tier": "unknown"})
    await rig.request(ctx)
    assert ctx.priority == 2


TOKENS = {"name": "tok", "key": ["claim:tenant"], "tokens_per_second": 100, "burst_tokens": 1000}


def chat(max_tokens: int | None = 100, stream: bool = False, **extra: Any) -> Any:
    doc: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}]}
    if max_tokens is not None:
        doc["max_tokens"] = max_tokens
    if stream:
        doc["stream"] = True
    doc.update(extra)
    return from_doc(b"{...}", doc)


async def test_tokens_reserved_and_settled_from_usage() -> None:
    rig = Rig({"rules": [TOKENS]})
    ctx = rig.ctx(claims={"tenant": "a"})
    assert await rig.request(ctx) is Status.CONTINUE
    assert rig.filter.on_body(ctx, chat(100)) is Status.CONTINUE
    ticket = ctx.reservation
    assert isinstance(ticket, Ticket) and ticket.tokens is not None
    assert ticket.tokens.reserved == 200  # 400 chars / 4 + max_tokens
    ks = next(iter(next(iter(rig.lim.rules.values())).keys.values()))
    assert ks.bucket.tokens == pytest.approx(800)
    ctx.usage = Usage(90, 30)
    ctx.outcome = Outcome.OK
    await rig.chain.on_response(ctx)
    assert ks.bucket.tokens == pytest.approx(1000 - 120)  # ends where the real usage says


async def test_empty_bucket_refuses_in_the_body_phase_and_gives_the_admission_back() -> None:
    rule = {**TOKENS, "qps": 100}
    rig = Rig({"rules": [rule]})
    ctxs = []
    for _ in range(8):
        ctx = rig.ctx(claims={"tenant": "a"})
        await rig.request(ctx)
        if ctx.verdict.allowed:
            rig.filter.on_body(ctx, chat(300))
        ctxs.append(ctx)
    codes = statuses(ctxs)
    assert codes[:3] == [200, 200, 200] and 429 in codes  # 1000 -> 600 -> 200 -> -200
    refused = next(c for c in ctxs if c.verdict.http_status == 429)
    h = dict(refused.verdict.headers)
    assert "x-ratelimit-remaining-tokens" in h and "x-ratelimit-limit-requests" in h


async def test_stream_gets_usage_asked_for_and_hidden() -> None:
    rig = Rig({"rules": [TOKENS]})
    ctx = rig.ctx(claims={"tenant": "a"})
    await rig.request(ctx)
    body = chat(10, stream=True)
    rig.filter.on_body(ctx, body)
    assert body.usage_added and body.doc is not None
    assert body.doc["stream_options"] == {"include_usage": True}
    asked = chat(10, stream=True, stream_options={"include_usage": True})
    ctx2 = rig.ctx(claims={"tenant": "a"})
    await rig.request(ctx2)
    rig.filter.on_body(ctx2, asked)
    assert not asked.usage_added


def sse(text: str) -> StreamEvent:
    doc = {"choices": [{"delta": {"content": text}}]}
    return StreamEvent(EventKind.SSE, data=b"...", doc=doc)


@pytest.mark.parametrize(("on_overrun", "cut"), [("cut", True), ("allow", False)])
async def test_overrunning_stream_is_cut_or_allowed(on_overrun: str, cut: bool) -> None:
    rig = Rig({"rules": [{**TOKENS, "on_overrun": on_overrun}], "default_max_tokens": 5})
    ctx = rig.ctx(claims={"tenant": "a"})
    await rig.request(ctx)
    rig.filter.on_body(ctx, chat(None, stream=True))  # reserved: 100 prompt + 5 default
    results = []
    for _ in range(8):
        results.append(rig.filter.on_event(ctx, sse("tok")))
        if results[-1] is Status.STOP:
            break  # the forwarding path ends the stream there
    if cut:
        assert results[:5] == [Status.CONTINUE] * 5 and results[5] is Status.STOP
        assert ctx.verdict.error_type == "token_overrun"
    else:
        assert set(results) == {Status.CONTINUE}
    ctx.outcome = Outcome.STREAM_CUT if cut else Outcome.OK
    ctx.first_byte_at = ctx.started
    await rig.chain.on_response(ctx)
    ks = next(iter(next(iter(rig.lim.rules.values())).keys.values()))
    streamed = 6 if cut else 8
    assert ks.bucket.tokens == pytest.approx(1000 - 100 - streamed)  # charged what was seen


async def test_grpc_reserves_the_default_and_settles_from_the_trailer() -> None:
    rig = Rig({"rules": [TOKENS], "grpc_usage_trailer": "x-mock-usage-tokens",
               "default_max_tokens": 300})  # fmt: skip
    ctx = rig.ctx(claims={"tenant": "g"}, protocol=Wire.GRPC)
    assert await rig.request(ctx) is Status.CONTINUE
    ks = next(iter(next(iter(rig.lim.rules.values())).keys.values()))
    assert ks.bucket.tokens == pytest.approx(700)
    ev = StreamEvent(EventKind.TRAILERS, metadata=(("x-other", "1"), ("x-mock-usage-tokens", "42")))
    rig.filter.on_event(ctx, ev)
    assert ctx.usage is not None and ctx.usage.total_tokens == 42
    await rig.chain.on_response(ctx)
    assert ks.bucket.tokens == pytest.approx(958)


async def test_a_request_that_never_reached_the_backend_is_refunded() -> None:
    rig = Rig({"rules": [{**TOKENS, "qps": 5}]})
    for _ in range(10):
        ctx = rig.ctx(claims={"tenant": "a"})
        await rig.request(ctx)
        rig.filter.on_body(ctx, chat(100))
        ctx.outcome = Outcome.UPSTREAM_CONNECT
        await rig.chain.on_response(ctx)
    ks = next(iter(next(iter(rig.lim.rules.values())).keys.values()))
    assert ks.bucket.tokens == pytest.approx(1000)


async def test_reload_keeps_unchanged_rules_and_restarts_changed_ones() -> None:
    rig = Rig({"rules": [RULE, {**TOKENS, "name": "tok"}]})
    await rig.send(5, 0.001, headers={"x-tenant": "a"}, claims={"tenant": "a"})
    before = {rs.rule.name: rs for rs in rig.lim.rules.values()}
    ks_before = before["per-tenant"].keys["a"]
    rig.load({"rules": [{**RULE, "enforce": False}, {**TOKENS, "name": "tok", "burst_tokens": 5}]})
    after = {rs.rule.name: rs for rs in rig.lim.rules.values()}
    assert after["per-tenant"] is before["per-tenant"]  # unchanged numbers: same state
    assert after["per-tenant"].keys["a"] is ks_before and not after["per-tenant"].rule.enforce
    assert after["tok"] is not before["tok"] and not after["tok"].keys  # changed: fresh


async def test_a_rollout_keeps_both_policies_synced_and_a_rollback_restores_the_stable_one() -> (
    None
):
    rig = Rig({"rules": [{**TOKENS, "name": "tok"}]})

    def chain(burst: int) -> Any:
        built = build_chain(policy({"rules": [{**TOKENS, "name": "tok", "burst_tokens": burst}]}),
                            rig.services)  # fmt: skip
        return next(f for f in built.filters if f.name == "ratelimit")

    def states(f: Any) -> list[Any]:
        return [rs for _, rs in (*f.early, *f.late)]

    stable, candidate, third = chain(5), chain(6), chain(7)
    stable.activate()
    candidate.activate()  # a staged rollout: the candidate serves beside the stable policy
    assert all(rig.lim.rules.get(rs.rule.ident) is rs for rs in states(stable) + states(candidate))
    stable.activate()  # rolled back: the stable policy's states are the synced ones again
    assert all(rig.lim.rules.get(rs.rule.ident) is rs for rs in states(stable))
    third.activate()  # two activations on, the candidate's changed rule is forgotten
    assert not {rs.rule.ident for rs in states(candidate)} & set(rig.lim.rules)
    assert all(rig.lim.rules.get(rs.rule.ident) is rs for rs in states(stable) + states(third))
    await rig.lim.aclose()


async def test_yellow_queue_waits_for_room_instead_of_refusing() -> None:
    rule = {"name": "q", "key": [], "qps": 20, "window_s": 0.1}  # 2 per 100 ms
    rig = Rig({"rules": [rule], "overload": {"yellow_delay_ms": 300}}, clock=MonotonicClock())
    rig.lim.compiled = rig.filter.c
    results = []
    for _ in range(6):
        ctx = rig.ctx()
        results.append(await rig.request(ctx))
    rs = next(iter(rig.lim.rules.values()))
    assert rs.counts[8] >= 1  # queued
    assert results.count(Status.CONTINUE) >= 4  # they waited for the window instead of a 429
    assert rig.lim.waiting == 0


async def test_yellow_queue_is_bounded() -> None:
    rule = {"name": "q", "key": [], "qps": 2, "window_s": 1.0}
    rig = Rig({"rules": [rule], "overload": {"yellow_delay_ms": 200, "queue_size": 1}},
              clock=MonotonicClock())  # fmt: skip
    ctxs = [rig.ctx() for _ in range(6)]
    results = await asyncio.gather(*(rig.request(c) for c in ctxs))
    assert results.count(Status.STOP) >= 3
    assert max(0, rig.lim.waiting) == 0


async def test_pool_colour_sheds_by_priority_when_the_backend_saturates() -> None:
    rl = {"priority": PRIO, "concurrency": {"initial_limit": 40, "min_limit": 1}}
    rig = Rig(rl)
    rig.lim.activate(rig.filter.c)  # creates the pools (and the loop)
    ctxs = []
    for _ in range(39):
        ctx = rig.ctx(headers={"x-tier": "gold"})
        assert await rig.request(ctx) is Status.CONTINUE
        ctxs.append(ctx)
    pool = rig.lim.pools["a"]
    assert pool.machine.colour.label == "red" and pool.limit.in_flight == 39
    free, gold = rig.ctx(headers={"x-tier": "free"}), rig.ctx(headers={"x-tier": "gold"})
    assert await rig.request(free) is Status.STOP and free.verdict.http_status == 503
    assert free.verdict.grpc_status == 14 and free.verdict.retry_after
    assert await rig.request(gold) is Status.CONTINUE  # the top class gets the last slots
    over = rig.ctx(headers={"x-tier": "gold"})
    assert await rig.request(over) is Status.STOP  # but never more than the limit
    assert "concurrency limit" in over.verdict.reason
    for c in [*ctxs, gold]:
        c.first_byte_at = c.started + 0.01
        await rig.chain.on_response(c)
    assert pool.limit.in_flight == 0
    assert pool.machine.colour.label == "red"  # a pool steps down only after a dwell
    rig.clock.t += 1.0
    pool.observe(rig.clock.t)
    assert pool.machine.colour.label == "green"
    await rig.services.aclose()


async def test_red_hands_persistent_sources_to_the_datapath() -> None:
    rule = {"name": "t", "key": [], "qps": 10, "tokens_per_second": 10, "burst_tokens": 10}
    overload = {"red_deny": True, "red_deny_after": 3, "yellow_delay_ms": 0}
    rig = Rig({"priority": PRIO, "rules": [rule], "overload": overload})
    denied: list[tuple[str, float | None]] = []
    rig.services.deny = lambda ip, ttl: denied.append((ip, ttl)) or True
    rs = next(iter(rig.lim.rules.values()))
    ks = rs.key("*", rig.clock.t)
    ks.bucket.tokens = 0.0
    for _ in range(20):
        rig.clock.t += 0.001
        ctx = rig.ctx(headers={"x-tier": "free"}, peer="203.0.113.9")
        await rig.request(ctx)
    assert ks.colour.label == "red"
    assert denied and denied[0] == ("203.0.113.9", None)


async def test_state_for_admin() -> None:
    rig = Rig({"rules": [RULE]})
    await rig.send(15, 0.001, headers={"x-tenant": "a"})
    st = rig.services.state()["ratelimit"]
    rule = st["rules"][0]
    assert rule["name"] == "per-tenant" and rule["keys"] == 1
    assert rule["hottest"][0]["key"] == "a"
    assert {"qps_utilisation", "token_utilisation", "pressure"} <= set(rule["hottest"][0])
    assert st["rejections"]["qps"] == 5
    assert st["colour"] == "yellow"  # a key is not green: the section asks for attention
    assert {"qps_util", "token_util", "pressure", "colour"} <= set(rule)
    assert rig.services.readiness()["ratelimit"]["mode"] == "memory"


async def test_keys_are_bounded_least_recently_used_first() -> None:
    rig = Rig({"rules": [RULE], "max_keys": 50})
    for i in range(500):  # an attacker rotating its key
        await rig.send(1, 0.0001, headers={"x-tenant": f"k{i}"})
    rs = next(iter(rig.lim.rules.values()))
    assert len(rs.keys) == 50 and rs.evicted == 450
    assert "k499" in rs.keys and "k0" not in rs.keys


async def test_a_reload_that_lowers_max_keys_trims_at_the_next_new_key() -> None:
    rig = Rig({"rules": [RULE], "max_keys": 500})
    for i in range(500):
        await rig.send(1, 0.0001, headers={"x-tenant": f"k{i}"})
    rig.load({"rules": [RULE], "max_keys": 50})  # the same rule: its keys are kept
    rs = next(iter(rig.lim.rules.values()))
    assert len(rs.keys) == 500
    await rig.send(1, 0.0001, headers={"x-tenant": "new"})
    assert len(rs.keys) == 50 and "new" in rs.keys and "k499" in rs.keys


async def test_keys_waiting_for_a_sync_stay_within_the_bound_while_redis_is_away() -> None:
    # While Redis is away a shared rule decides locally and keeps every key it touched for the
    # next sync: a key forgotten leaves that list too, else an outage would keep every key a
    # client ever sent (one per source address...).
    rig = Rig({"rules": [RULE], "max_keys": 50})
    rig.lim.store = MemoryStore()  # shared: touched keys wait for the next sync (no loop here)
    rig.lim.fallback("away")
    rs = next(iter(rig.lim.rules.values()))
    first = await rig.send(12, 0.0001, headers={"x-tenant": "k0"})
    assert statuses(first)[-2:] == [429, 429]  # k0 used its window up (10 a second)
    for i in range(1, 1050):
        await rig.send(1, 0.0001, headers={"x-tenant": f"k{i}"})
    assert len(rs.keys) == 50 and rs.evicted == 1000
    assert len(rs.dirty) <= 50 and set(rs.dirty) <= set(rs.keys)
    # Forgotten, k0 comes back as a new key: a fresh window, within the same second.
    assert statuses(await rig.send(1, 0.0001, headers={"x-tenant": "k0"})) == [200]


async def test_a_forgotten_key_holding_a_share_gives_it_back_at_the_next_sync() -> None:
    rig = Rig({"rules": [RULE], "max_keys": 5})
    lim = rig.lim
    store = MemoryStore(clock=lambda: rig.clock.t)
    lim.store, lim.store_cfg = store, RedisStoreOptions()
    lim.set_mode("redis")
    await rig.send(1, 0.0001, headers={"x-tenant": "k0"})
    await sync_once(lim)
    rs = next(iter(lim.rules.values()))
    k0 = rs.keys["k0"]
    assert k0.leased and rs.leased == {"k0": k0}
    for i in range(1, 20):
        await rig.send(1, 0.0001, headers={"x-tenant": f"k{i}"})
    assert "k0" not in rs.keys and rs.leased.get("k0") is k0  # kept until its share is back
    assert len(rs.dirty) <= 5
    rig.clock.t += IDLE_S + 1.0
    await sync_once(lim)
    assert "k0" not in rs.leased and not k0.leased  # idle: the share went back to the store
    assert len(rs.leased) <= 5


async def test_memory_store_gives_each_worker_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_WORKERS", "4")  # what `serve --workers 4` sets for its workers
    rig = Rig({"rules": [{"name": "w", "key": [], "qps": 40}]})
    ctxs = await rig.send(20, 0.0001)
    assert statuses(ctxs).count(200) == 10  # 40 / 4 per worker


@pytest.mark.parametrize("pool", [False, True])
async def test_a_leased_share_running_low_wakes_the_sync_only_for_what_the_rule_limits(
    pool: bool,
) -> None:
    # Both request paths take the same per-rule step: without a token rule and a pool (the path
    # that holds nothing) and with them (the path with a Ticket).
    rules = [{"name": "per-ip", "key": ["source_ip"], "qps": 1000}]
    if pool:
        rules.append({**RULE, "qps": 1000, "tokens_per_second": 1000, "burst_tokens": 1000})
    section: dict[str, Any] = {"rules": rules}
    if pool:
        section["concurrency"] = {}
    rig = Rig(section)
    assert rig.filter.simple is not pool
    rig.lim.store = object()  # shared: keys are leased and synced (no loop runs here)
    await rig.send(1, 0.001, headers={"x-tenant": "t"})
    keys = [ks for rs in rig.lim.rules.values() for ks in rs.keys.values()]
    for ks in keys:
        ks.leased, ks.req_share, ks.tok_share = True, 100.0, 1000.0
    qps_only = next(iter(rig.lim.rules.values())).keys["10.0.0.1"]
    qps_only.tok_share = 0.0  # a QPS-only rule holds no token share
    rig.lim.wake.clear()
    await rig.send(1, 0.001, headers={"x-tenant": "t"})
    assert not rig.lim.wake.is_set()
    qps_only.req_share = 0.5  # its request share runs low: sync now
    await rig.send(1, 0.001, headers={"x-tenant": "t"})
    assert rig.lim.wake.is_set()
