"""Sticky prefix placement with bounded load: table-driven, pure, time passed in."""

from __future__ import annotations

import math
import random

import pytest

from gateway.core.balancer import hash_key
from gateway.core.placement import (
    BURST_SLACK,
    SMOOTH_S,
    Placement,
    PrefixBook,
    place,
    rank,
    smooth,
)
from tests.core.test_balancer_members import M


def members(n: int) -> list[M]:
    return [M(f"m{i}") for i in range(n)]


def order_of(ms: list[M], key: int) -> list[M]:
    return sorted(ms, key=lambda m: rank(key, m, True), reverse=True)


def test_smooth_is_the_exact_time_average_of_a_step() -> None:
    assert smooth(0.0, 4.0, 0.0) == 0.0
    assert smooth(0.0, 4.0, SMOOTH_S) == pytest.approx(4.0 * (1 - math.exp(-1)))
    assert smooth(2.0, 2.0, 100.0) == 2.0
    p = Placement(0, now=0.0)
    p.add(0.0, 1)
    p.add(0.0, 1)  # two in flight from t=0
    assert p.current(SMOOTH_S) == pytest.approx(2 * (1 - math.exp(-1)))
    p.add(SMOOTH_S, -1)
    p.add(SMOOTH_S, -5)  # never below zero
    assert p.in_flight == 0
    assert p.current(50 * SMOOTH_S) == pytest.approx(0.0, abs=1e-9)


def test_a_new_prefix_takes_its_rendezvous_member_and_stays() -> None:
    ms = members(4)
    book = PrefixBook()
    for i in range(50):
        key = hash_key(f"p{i}")
        want = order_of(ms, key)[0]
        assert place(book, ms, key, 1.25, now=0.0) is want
        assert book.where(key) == want.hash_key
        want.in_flight += 3  # busier now, but within its burst room: it stays
        assert place(book, ms, key, 1.25, now=0.1) is want
        want.in_flight -= 3


@pytest.mark.parametrize(
    ("loads", "factor", "want_rank"),
    [
        ([0, 0, 0, 0], 1.25, 0),  # idle: the key's own member
        ([5, 0, 0, 0], 1.25, 1),  # its average is above 1.25 x its share: the next one
        ([5, 5, 0, 0], 1.25, 2),  # the next one has no room for it either
        ([2, 1, 1, 1], 2.0, 0),  # within 2 x its share: stays
        ([3, 1, 1, 1], 2.0, 0),  # 3 = 2 x 6 / 4
        ([4, 1, 1, 1], 2.0, 1),
        ([2, 2, 2, 2], 1.0, 0),  # all equal: the first still fits
        ([9, 9, 9, 0], 1.25, 3),
        ([1, 0, 0, 0], 1.25, 0),  # one request's worth is never over its bound
    ],
)
def test_the_bound_on_averages(loads: list[int], factor: float, want_rank: int) -> None:
    """Members never averaged start their average at their load now."""
    ms = members(4)
    key = hash_key("prefix")
    ranked = order_of(ms, key)
    for m, load in zip(ranked, loads, strict=True):
        m.in_flight = load
    assert place(PrefixBook(), ms, key, factor, now=0.0) is ranked[want_rank]


def test_heartbeat_load_counts_as_in_flight() -> None:
    ms = members(2)
    key = hash_key("k")
    first, second = order_of(ms, key)
    first.load = 100.0  # a full server: 10 more in flight
    assert place(PrefixBook(), ms, key, 1.25, now=0.0) is second


def test_an_overloaded_member_sheds_whole_prefixes_with_their_load() -> None:
    ms = members(4)
    book = PrefixBook()
    key = hash_key("p")
    home, nxt = order_of(ms, key)[:2]
    assert place(book, ms, key, 1.25, now=0.0) is home
    p = book.placed[key]
    assert p.in_flight == 1  # the prefix has a request in flight (the one placed) ...
    home.in_flight = 6  # ... on a member far busier than its share for a while
    t = 4 * SMOOTH_S
    before = smooth(0.0, 6.0, t)
    got = place(book, ms, key, 1.25, now=t)
    assert got is nxt and book.where(key) == nxt.hash_key and book.moves == 1
    own = p.current(t)
    # The prefix's average moved with it: the old member's went down, the new one's up.
    assert nxt.avg == pytest.approx(own)
    assert home.avg == pytest.approx(before - own)
    assert place(book, ms, key, 1.25, now=t + 0.01) is nxt  # and it stays there


def test_a_prefix_larger_than_a_share_stays() -> None:
    """Moving it would only overload another member: the others have to move instead."""
    ms = members(4)
    book = PrefixBook()
    key = hash_key("p")
    home = order_of(ms, key)[0]
    place(book, ms, key, 1.25, now=0.0)
    book.placed[key].add(0.0, 3)  # 4 of its requests in flight
    home.in_flight = 6
    assert place(book, ms, key, 1.25, now=4 * SMOOTH_S) is home and book.moves == 0


def test_a_burst_spills_single_requests_and_keeps_the_placement() -> None:
    ms = members(4)
    book = PrefixBook()
    key = hash_key("p")
    home, nxt = order_of(ms, key)[:2]
    assert place(book, ms, key, 1.25, now=0.0) is home
    home.in_flight = int(BURST_SLACK) + 2  # right now, above the mean + the slack
    assert place(book, ms, key, 1.25, now=0.001) is nxt
    assert book.where(key) == home.hash_key  # the prefix still lives there


def test_a_retry_leaves_the_placement() -> None:
    ms = members(3)
    book = PrefixBook()
    key = hash_key("p")
    home = place(book, ms, key, 1.25, now=0.0)
    others = [m for m in ms if m is not home]
    assert place(book, others, key, 1.25, now=0.1, keep=False) in others
    assert book.where(key) == home.hash_key
    assert place(book, others, key, 1.25, now=0.2) in others  # its member left: re-placed
    assert book.where(key) != home.hash_key


def test_the_book_is_bounded_and_keeps_what_is_used() -> None:
    ms = members(2)
    book = PrefixBook(capacity=4)
    keep = hash_key("used")
    place(book, ms, keep, 1.25, now=0.0)
    for i in range(10):
        place(book, ms, hash_key(f"k{i}"), 1.25, now=0.0)
        place(book, ms, keep, 1.25, now=0.0)  # used again: the least recently used go first
    assert len(book.placed) == 4 and keep in book.placed


def test_weights_set_the_share() -> None:
    a, b = M("a", weight=3.0), M("b")
    key = next(k for k in (hash_key(f"x{i}") for i in range(100)) if order_of([a, b], k)[0] is a)
    a.in_flight, b.in_flight = 6, 2  # 6 of 8 is a's share of 3/4: within 1.25 x it
    assert place(PrefixBook(), [a, b], key, 1.25, now=0.0) is a
    a.in_flight, b.in_flight = 16, 1  # 16 of 17 is over 1.25 x its share of 12.75
    a.avg_at = b.avg_at = -1.0  # averages start again from the loads now
    assert place(PrefixBook(), [a, b], key, 1.25, now=0.0) is b


@pytest.mark.parametrize("factor", [1.1, 1.25, 1.5])
def test_a_hot_prefix_never_piles_up(factor: float) -> None:
    """A burst of requests that never finish, nearly all of one prefix: no member passes the
    burst bound, max(ceil(factor x mean), mean + slack) with the new request counted, and with
    hundreds in flight that is factor x the mean."""
    ms = members(4)
    book = PrefixBook()
    rnd = random.Random(7)
    hot = hash_key("hot")
    for i in range(800):
        key = hot if i % 10 else hash_key(f"cold{rnd.random()}")
        m = place(book, ms, key, factor, now=i * 1e-4)
        assert m is not None
        total = sum(x.in_flight for x in ms) + 1
        m.in_flight += 1
        mean = total / len(ms)
        assert m.in_flight <= max(math.ceil(factor * mean), mean + BURST_SLACK)
    mean = sum(x.in_flight for x in ms) / len(ms)
    assert max(x.in_flight for x in ms) <= factor * mean + 1


@pytest.mark.parametrize(("hot", "max_moves"), [(1.0, 5), (10.0, 10)])
def test_prefixes_settle_within_the_bound(hot: float, max_moves: int) -> None:
    """Open loop at ~3 requests in flight per member, 32 prefixes (the first `hot` x as hot as
    each other one), requests 0.34 s long: once the averages have settled, the time-averaged
    in-flight of every member stays within the load factor of the mean, and few prefixes move
    (of ~660 requests in those 20 s)."""
    ms = members(4)
    book = PrefixBook()
    rnd = random.Random(5)
    keys = [hash_key(f"g{g}") for g in range(32)]
    weights = [hot] + [1.0] * 31
    ends: list[tuple[float, M, int]] = []
    t = 0.0
    area = dict.fromkeys(ms, 0.0)
    settle, until = 10.0, 30.0
    moves_at_settle = 0
    while t < until:
        dt = rnd.expovariate(33.0)
        if t >= settle:
            for m in ms:
                area[m] += m.in_flight * dt
        elif t + dt >= settle:
            moves_at_settle = book.moves
        t += dt
        while ends and ends[0][0] <= t:
            _, m, key = ends.pop(0)
            m.in_flight -= 1
            book.finished(key, t)
        key = rnd.choices(keys, weights)[0]
        m = place(book, ms, key, 1.25, now=t)  # counted in the prefix's load
        assert m is not None
        m.in_flight += 1
        ends.append((t + 0.34, m, key))
        ends.sort(key=lambda e: e[0])
    means = [area[m] / (until - settle) for m in ms]
    assert max(means) <= 1.25 * sum(means) / len(means)
    assert book.moves - moves_at_settle <= max_moves
