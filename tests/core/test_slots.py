"""The fleet's slot rules (gateway.core.slots)."""

from __future__ import annotations

from gateway.core import slots as r


def test_want_is_use_and_waiters_plus_one_and_nothing_when_idle() -> None:
    assert r.want(0, 0, 8) == 0
    assert r.want(2, 0, 8) == 3
    assert r.want(4, 10, 8) == 8
    assert r.want(0, 1, 8) == 2


def test_fair_target_is_water_filling() -> None:
    assert r.fair_target(8, [48], 48) == 8  # alone: everything
    assert r.fair_target(8, [48, 0, 0], 48) == 8  # the idle ones want nothing
    assert r.fair_target(8, [24, 24], 24) == 4
    assert r.fair_target(8, [2, 24], 24) == 6  # the small want is met, the rest to the big
    assert r.fair_target(8, [2, 24], 2) == 2
    assert r.fair_target(8, [9, 9, 9], 9) == 3  # 8/3 rounded up
    assert sum(r.fair_target(8, [9, 9, 9], 9) for _ in range(3)) >= 8


def test_grant_never_passes_what_is_free_nor_the_recovery_cap() -> None:
    assert r.grant(8, want_=8, target=8, others_held=3) == 5
    assert r.grant(8, want_=8, target=4, others_held=0) == 4
    assert r.grant(8, want_=8, target=8, others_held=9) == 0
    assert r.grant(8, want_=8, target=8, others_held=0, recovering_cap=2) == 2


def test_fallback_share_rounds_down_but_serves() -> None:
    assert r.fallback_share(8, 3) == 2
    assert r.fallback_share(8, 1) == 8
    assert r.fallback_share(2, 5) == 1
    assert r.fallback_share(8, 0) == 8


def test_next_sync() -> None:
    ttl = r.lease_ttl(0.05)
    assert ttl == 1.0 and r.lease_ttl(0.1) == 2.0
    idle = r.Reply(0, 0, 0, 0, 0, False)
    assert r.next_sync(10.0, 0.05, ttl, 0, idle, 1) == (None, 1)
    # Slots on their way: ask again at the next interval.
    growing = r.Reply(2, 2, 8, 8, 6, True)
    assert r.next_sync(10.0, 0.05, ttl, 6, growing, 1) == (10.05, 1)
    # At its fair share and still hungry: back off, at most to the renewal period.
    at_share = r.Reply(4, 4, 8, 8, 4, True)
    at, b = r.next_sync(10.0, 0.05, ttl, 9, at_share, 1)
    assert at == 10.05 and b == 2
    at, b = r.next_sync(10.0, 0.05, ttl, 9, at_share, 8)
    assert at == 10.0 + 0.25 and b == 8
    # A surplus others wait for goes back at once; else the lease is renewed.
    surplus = r.Reply(6, 6, 8, 6, 6, True)
    assert r.next_sync(10.0, 0.05, ttl, 2, surplus, 1)[0] == 10.05
    draining = r.Reply(4, 6, 8, 8, 4, True)  # holds 6 in use, granted 4: frees each as it ends
    assert r.next_sync(10.0, 0.05, ttl, 9, draining, 8) == (10.05, 1)
    calm = r.Reply(6, 6, 6, 6, 6, False)
    assert r.next_sync(10.0, 0.05, ttl, 2, calm, 1)[0] == 10.25


def test_due_now() -> None:
    assert r.due_now(5, 4, 4, 4, False)  # wants more than granted; the last ask was met
    assert not r.due_now(9, 9, 4, 4, True)  # capped at its fair share: the schedule re-asks
    assert r.due_now(1, 0, 0, 0, False)  # newly wanted
    assert r.due_now(1, 3, 4, 4, True)  # surplus and others wait
    assert not r.due_now(1, 3, 4, 4, False)
    assert not r.due_now(3, 3, 4, 4, False)
