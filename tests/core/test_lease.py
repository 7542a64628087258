"""Leased shares between replicas, driven by hand against the memory twin of the Lua."""

from __future__ import annotations

import asyncio

import pytest

from gateway.core.clock import ManualClock
from gateway.core.keystate import Code, KeyState, RuleMath
from gateway.core.lease import apply, drop, report, restore
from gateway.store.base import KeyParams, SyncOp
from gateway.store.memory import MemoryStore

M = RuleMath.of(qps=100, window_s=1.0, rate=1000, burst=1000)
P = KeyParams(M.limit, M.window_s, M.rate, M.burst, M.weights.q, M.weights.t)


def sync(store: MemoryStore, ks: KeyState, now: float, key: str = "k") -> None:
    r = report(ks, M, now, min_tokens=50)
    if r is None:
        return
    op = SyncOp(key, P, r.req_delta, r.tok_delta, r.offered, r.want_req, r.want_tok, r.reset)
    (res,) = asyncio.run(store.sync([op]))
    apply(ks, r, res.granted_req, res.granted_tok, res.admitted, res.offered, res.tokens)


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_replicas_sharing_one_store_hold_the_global_limit(replicas: int) -> None:
    clock = ManualClock(1000.0)
    store = MemoryStore(clock.now)
    keys = [KeyState(M, 1.0 / replicas, clock.t) for _ in range(replicas)]
    admitted = 0
    # 3 seconds at 300 req/s offered in total (3x the limit), syncing every 50 ms.
    for step in range(3000):
        clock.t += 0.001
        ks = keys[step % replicas]
        if ks.request(M, 1.0 / replicas, clock.t) is Code.ADMIT:
            admitted += 1
            ks.reserve(M, 1.0 / replicas, clock.t, 1.0)
        if step % 50 == 49:
            for k in keys:
                sync(store, k, clock.t)
    assert 0.85 * 300 <= admitted <= 300 * 1.05 + replicas * 5


def test_first_lease_charges_what_was_admitted_before_it() -> None:
    clock = ManualClock(50.0)
    store = MemoryStore(clock.now)
    ks = KeyState(M, 1.0, clock.t)
    for _ in range(10):
        assert ks.request(M, 1.0, clock.t) is Code.ADMIT
    assert ks.adm_unleased == 10
    sync(store, ks, clock.t)
    assert ks.leased and ks.adm_unleased == 0
    assert ks.g_adm == pytest.approx(10 + ks.req_share)  # charged, and the new share counted


def test_use_during_the_round_trip_is_not_lost() -> None:
    clock = ManualClock(50.0)
    store = MemoryStore(clock.now)
    ks = KeyState(M, 1.0, clock.t)
    ks.request(M, 1.0, clock.t)
    sync(store, ks, clock.t)
    share = ks.req_share
    r = report(ks, M, clock.t, 50)
    assert r is not None
    ks.request(M, 1.0, clock.t)  # admitted while the report travels
    op = SyncOp("k", P, r.req_delta, r.tok_delta, r.offered, r.want_req, r.want_tok)
    (res,) = asyncio.run(store.sync([op]))
    apply(ks, r, res.granted_req, res.granted_tok, res.admitted, res.offered, res.tokens)
    assert ks.req_share == res.granted_req - 1
    assert share >= 1


def test_idle_key_gives_its_share_back() -> None:
    clock = ManualClock(50.0)
    store = MemoryStore(clock.now)
    ks = KeyState(M, 1.0, clock.t)
    ks.request(M, 1.0, clock.t)
    sync(store, ks, clock.t)
    assert ks.leased
    clock.t += 5.0
    sync(store, ks, clock.t)
    assert not ks.leased and ks.req_share == 0
    assert report(ks, M, clock.t, 50) is None  # nothing more to say


def test_failed_sync_restores_the_report_and_goes_local() -> None:
    clock = ManualClock(50.0)
    ks = KeyState(M, 1.0, clock.t)
    for _ in range(3):
        ks.request(M, 1.0, clock.t)
    ks.reserve(M, 1.0, clock.t, 40.0)
    r = report(ks, M, clock.t, 50)
    assert r is not None and ks.adm_unleased == 0
    restore(ks, r)
    assert ks.adm_unleased == 3 and ks.tok_unleased == 40 and ks.off_since == 3
    assert not ks.leased


def test_drop_charges_what_was_taken_beyond_the_share() -> None:
    ks = KeyState(M, 1.0, 0.0)
    ks.leased, ks.req_share, ks.tok_share = True, -2.0, -30.0
    drop(ks)
    assert (ks.adm_unleased, ks.tok_unleased, ks.leased) == (2.0, 30.0, False)
