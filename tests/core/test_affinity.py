"""Prompt-prefix keys and the bounded-load rendezvous choice: table-driven, pure, seeded."""

from __future__ import annotations

import random
import zlib
from typing import Any

import pytest

from gateway.core.affinity import (
    bounded_order,
    pick_affinity,
    pick_allowed,
    prefix_key,
    prompt_prefix,
)
from gateway.core.balancer import build_plan, hash_key
from tests.core.test_balancer_members import M, status

SYS = {"role": "system", "content": "You are terse."}


@pytest.mark.parametrize(
    ("doc", "n", "want"),
    [
        ({"messages": [SYS, {"role": "user", "content": "hi"}]}, 100,
         b"system\x1fYou are terse.\x1euser\x1fhi\x1e"),
        ({"messages": [{"role": "user", "content": "hi"}, SYS]}, 100,  # system first
         b"system\x1fYou are terse.\x1euser\x1fhi\x1e"),
        ({"messages": [SYS, {"role": "user", "content": "hi"}]}, 8, b"system\x1fY"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                     {"type": "image_url"}]}]}, 100,
         b"user\x1fa\x1e"),
        ({"prompt": "once upon a time"}, 4, b"once"),
        ({"prompt": ["first", "second"]}, 100, b"first"),
        ({"model": "m"}, 100, b""),
        ({"messages": "junk"}, 100, b""),
    ],
)  # fmt: skip
def test_prompt_prefix(doc: dict[str, Any], n: int, want: bytes) -> None:
    assert prompt_prefix(doc, n) == want


@pytest.mark.parametrize("system", ["s" * 3000, "é" * 3000, "s" * 2048, "日本" * 1100, "s" * 9])
def test_the_long_system_prompt_shortcut_hashes_the_same_bytes(system: str) -> None:
    doc = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "q"}]}
    prefix = prompt_prefix(doc, 2048)
    crc = zlib.crc32(prefix)
    assert prefix_key(doc, 2048) == ((crc << 32 | len(prefix)) * 0x9E3779B97F4A7C15) % 2**64


def test_the_key_depends_on_the_first_bytes_only() -> None:
    base = "s" * 3000
    a = {"messages": [{"role": "system", "content": base}, {"role": "user", "content": "1"}]}
    b = {"messages": [{"role": "system", "content": base}, {"role": "user", "content": "2"}]}
    assert prefix_key(a, 2048) == prefix_key(b, 2048)
    assert prefix_key(a, 4096) != prefix_key(b, 4096)
    assert prefix_key({"model": "m"}, 2048) is None


def members(n: int) -> list[M]:
    return [M(f"m{i}") for i in range(n)]


def order_of(ms: list[M], key: int) -> list[M]:
    """The rendezvous order, read off by taking the first choice away one at a time."""
    out, rest = [], list(ms)
    while rest:
        m = bounded_order(rest, key, 10.0)
        assert m is not None
        out.append(m)
        rest.remove(m)
    return out


@pytest.mark.parametrize(
    ("loads", "factor", "want_rank"),
    [
        ([0, 0, 0, 0], 1.25, 0),  # idle: the key's own member
        ([5, 0, 0, 0], 1.25, 1),  # it is busier than 1.25 x the mean: the next one
        ([5, 5, 0, 0], 1.25, 2),
        ([2, 1, 1, 1], 2.0, 0),  # within 2 x the mean: stays
        ([3, 1, 1, 1], 2.0, 0),  # 4 fits ceil(2 x 7 / 4)
        ([4, 1, 1, 1], 2.0, 1),
        ([2, 2, 2, 2], 1.0, 0),  # all equal: the first still fits
        ([9, 9, 9, 0], 1.25, 3),
    ],
)
def test_bounded_walk(loads: list[int], factor: float, want_rank: int) -> None:
    ms = members(4)
    key = hash_key("prefix")
    ranked = order_of(ms, key)
    for m, load in zip(ranked, loads, strict=True):
        m.in_flight = load
    assert bounded_order(ms, key, factor) is ranked[want_rank]


def test_heartbeat_load_counts_as_in_flight() -> None:
    ms = members(2)
    key = hash_key("k")
    first, second = order_of(ms, key)
    first.load = 100.0  # a full server: 10 more in flight
    assert bounded_order(ms, key, 1.25) is second


def test_losing_a_member_moves_only_its_prefixes() -> None:
    ms = members(5)
    plan = build_plan([status(m) for m in ms], 0.5)
    keys = [hash_key(f"p{i}") for i in range(2000)]
    before = {k: pick_affinity(plan, k, 1.25, None) for k in keys}
    assert len({m.name for m in before.values() if m}) == 5
    lost = ms[2]
    plan2 = build_plan([status(m) for m in ms if m is not lost], 0.5)
    moved = 0
    for k in keys:
        after = pick_affinity(plan2, k, 1.25, None)
        if before[k] is lost:
            moved += 1
        else:
            assert after is before[k]
    assert 250 < moved < 550  # about a fifth


@pytest.mark.parametrize("factor", [1.1, 1.25, 1.5, 2.0])
def test_a_hot_prefix_spreads_within_the_bound(factor: float) -> None:
    """Requests that never finish, all of one prefix but a few: no member passes factor x
    the mean (+1 request, the one being placed)."""
    ms = members(4)
    plan = build_plan([status(m) for m in ms], 0.5)
    rnd = random.Random(7)
    hot = hash_key("hot")
    for i in range(400):
        key = hot if i % 10 else hash_key(f"cold{rnd.random()}")
        m = pick_affinity(plan, key, factor, None)
        assert m is not None
        m.in_flight += 1
        mean = sum(x.in_flight for x in ms) / len(ms)
        assert max(x.in_flight for x in ms) <= factor * mean + 1


def test_ok_and_levels() -> None:
    primary, secondary = members(3), [M("s0"), M("s1")]
    down = primary[0]  # a third of the primary down: 7 % of the traffic spills to level 1
    statuses = [status(m, available=m is not down) for m in primary]
    plan = build_plan(statuses + [status(m, 1) for m in secondary], 0.5)
    assert len(plan.levels) == 2
    key = hash_key("k")
    assert pick_affinity(plan, key, 1.25, None) in primary[1:]
    only = secondary[1]
    assert pick_affinity(plan, key, 1.25, lambda m: m is only) is only  # the next level
    assert pick_affinity(plan, key, 1.25, lambda m: False) is None
    rnd = random.Random(3).random
    assert {pick_allowed(plan, rnd, lambda m: m is only) for _ in range(20)} == {only}
    assert pick_allowed(plan, rnd, lambda m: False) is None


def test_pick_allowed_prefers_the_less_loaded_and_follows_weights() -> None:
    a, b, c = M("a"), M("b", weight=3.0), M("c")
    plan = build_plan([status(a), status(b), status(c)], 0.5)
    rnd = random.Random(11).random
    ok = {a, b}.__contains__
    got = [pick_allowed(plan, rnd, ok) for _ in range(400)]
    assert c not in got and got.count(b) > got.count(a)
    a.in_flight = 50
    assert {pick_allowed(plan, rnd, ok) for _ in range(50)} == {b}
