"""Prompt-prefix keys and the member choice over priority levels: table-driven, pure, seeded
(the placement itself: tests/core/test_placement.py)."""

from __future__ import annotations

import random
import zlib
from typing import Any

import pytest

from gateway.core.affinity import pick_affinity, pick_allowed, prefix_key, prompt_prefix
from gateway.core.balancer import build_plan, hash_key
from gateway.core.placement import PrefixBook
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


def test_losing_a_member_moves_only_its_prefixes() -> None:
    ms = members(5)
    plan = build_plan([status(m) for m in ms], 0.5)
    book = PrefixBook()
    keys = [hash_key(f"p{i}") for i in range(2000)]
    before = {k: pick_affinity(plan, k, 1.25, None, book, 0.0) for k in keys}
    assert len({m.name for m in before.values() if m}) == 5
    lost = ms[2]
    plan2 = build_plan([status(m) for m in ms if m is not lost], 0.5)
    fresh = PrefixBook()  # another replica, which never saw these prefixes: the same choice
    moved = 0
    for k in keys:
        after = pick_affinity(plan2, k, 1.25, None, book, 1.0)
        if before[k] is lost:
            moved += 1
            assert after is not lost
        else:
            assert after is before[k]
        assert pick_affinity(plan2, k, 1.25, None, fresh, 1.0) is after
    assert 250 < moved < 550  # about a fifth


def test_ok_and_levels() -> None:
    primary, secondary = members(3), [M("s0"), M("s1")]
    down = primary[0]  # a third of the primary down: 7 % of the traffic spills to level 1
    statuses = [status(m, available=m is not down) for m in primary]
    plan = build_plan(statuses + [status(m, 1) for m in secondary], 0.5)
    assert len(plan.levels) == 2
    key = hash_key("k")
    book = PrefixBook()
    assert pick_affinity(plan, key, 1.25, None, book, 0.0) in primary[1:]
    only = secondary[1]
    assert pick_affinity(plan, key, 1.25, lambda m: m is only, book, 0.0) is only  # next level
    assert pick_affinity(plan, key, 1.25, lambda m: False, book, 0.0) is None
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
