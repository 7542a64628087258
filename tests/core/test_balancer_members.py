"""The member choice: priority levels and spill-over, panic threshold, weighted power of two
choices on in-flight requests and heartbeat load, sticky rendezvous hashing, exclusions."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from gateway.core.balancer import (
    MemberStatus,
    Plan,
    build_plan,
    hash_key,
    pick,
    pick_excluding,
    pick_sticky,
    split_sticky,
)


@dataclass(eq=False)
class M:
    name: str
    weight: float = 1.0
    in_flight: int = 0
    load: float = 0.0
    server: float = 0.0  # what the model server's figures add (gateway.core.serverload)
    hash_key: int = 0
    avg: float = 0.0  # the placement's time average (gateway.core.placement)
    avg_at: float = -1.0

    def __post_init__(self) -> None:
        self.hash_key = hash_key(self.name)

    @property
    def core(self) -> M:  # the live figures live on the test member itself
        return self

    def __repr__(self) -> str:
        return self.name


def status(
    m: M,
    prio: int = 0,
    available: bool = True,
    admissible: bool = True,
    probing: bool = False,
) -> MemberStatus[M]:
    return MemberStatus(m, prio, m.weight, available, admissible, probing)


def shares(plan: Plan[M], n: int = 4000, seed: int = 1) -> Counter[str]:
    rnd = random.Random(seed).random
    got: Counter[str] = Counter()
    for _ in range(n):
        m = pick(plan, rnd)
        got[m.name if m else "-"] += 1
    return got


A, B, C, D = M("a"), M("b"), M("c"), M("d")


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        # all primary up: secondary gets nothing
        ([status(A), status(B), status(C, 1)], {"a": 0.5, "b": 0.5}),
        # primary 1 of 2 up: health 0.7 → 70 % stays, 30 % spills
        ([status(A), status(B, available=False), status(C, 1)], {"a": 0.7, "c": 0.3}),
        # primary all down: all to secondary
        ([status(A, available=False), status(B, available=False), status(C, 1)], {"c": 1.0}),
        # 3 of 4 up: 1.4 × 0.75 ≥ 1, no spill
        (
            [status(A), status(B), status(C), status(D, available=False), status(M("e"), 1)],
            {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3},
        ),
    ],
)
def test_priority_levels_spill_as_health_drops(
    statuses: list[MemberStatus[M]], expected: dict[str, float]
) -> None:
    plan = build_plan(statuses, panic_threshold=0.5)
    got = shares(plan)
    assert set(got) == set(expected)
    for name, share in expected.items():
        assert got[name] / 4000 == pytest.approx(share, abs=0.03)


def test_panic_uses_unhealthy_members_but_not_open_breakers() -> None:
    # 1 of 4 available (< 0.5): panic; b, c failed health (admissible), d's breaker is open.
    plan = build_plan(
        [
            status(A),
            status(B, available=False),
            status(C, available=False),
            status(D, available=False, admissible=False),
        ],
        panic_threshold=0.5,
    )
    assert plan.levels[0].panic
    assert set(shares(plan)) == {"a", "b", "c"}


def test_no_panic_above_threshold() -> None:
    plan = build_plan([status(A), status(B, available=False)], panic_threshold=0.5)
    assert not plan.levels[0].panic  # 50 % available: not below the threshold
    assert set(shares(plan)) == {"a"}


def test_panic_threshold_zero_never_uses_unavailable_members() -> None:
    plan = build_plan([status(A, available=False)], panic_threshold=0.0)
    assert plan.empty and pick(plan, random.random) is None
    plan = build_plan([status(A, available=False)], panic_threshold=0.5)
    assert pick(plan, random.random) is A  # the single sidecar member, in panic


def test_everything_breaker_open_leaves_nothing() -> None:
    plan = build_plan([status(A, available=False, admissible=False)], panic_threshold=1.0)
    assert plan.empty


def test_weight_zero_and_probing_members() -> None:
    z = M("z", weight=0)
    plan = build_plan([status(A), MemberStatus(z, 0, 0.0, True, True), status(B, available=False,
                       admissible=False, probing=True)], 0.5)  # fmt: skip
    assert plan.members == 2 and plan.available == 1 and plan.probing == (B,)
    assert set(shares(plan)) == {"a"}


@pytest.mark.parametrize(("wa", "wb"), [(1, 1), (3, 1), (9, 1)])
def test_idle_members_share_in_proportion_to_weight(wa: float, wb: float) -> None:
    a, b = M("a", weight=wa), M("b", weight=wb)
    got = shares(build_plan([status(a), status(b)], 0.5), n=8000)
    assert got["a"] / 8000 == pytest.approx(wa / (wa + wb), abs=0.02)


def test_busy_member_loses_to_idle_one() -> None:
    a, b = M("a", in_flight=10), M("b", in_flight=0)
    assert shares(build_plan([status(a), status(b)], 0.5)) == Counter({"b": 4000})


def test_heartbeat_load_counts_as_busy() -> None:
    a, b = M("a", load=90.0), M("b", load=0.0)
    plan = build_plan([status(a), status(b)], 0.5)
    assert shares(plan) == Counter({"b": 4000})
    b.in_flight = 10  # 10 in flight > 90 × 0.1: now a wins
    assert shares(plan) == Counter({"a": 4000})


def test_server_figures_count_as_busy() -> None:
    a, b = M("a", server=6.0), M("b", in_flight=5)
    plan = build_plan([status(a), status(b)], 0.5)
    assert shares(plan) == Counter({"b": 4000})
    b.in_flight = 7  # 7 of our own in flight > 6 the server's figures add for a
    assert shares(plan) == Counter({"a": 4000})


def test_p2c_with_many_members_spreads_load() -> None:
    members = [M(f"m{i}") for i in range(10)]
    plan = build_plan([status(m) for m in members], 0.5)
    rnd = random.Random(3).random
    for _ in range(1000):  # requests that never finish: in-flight grows where chosen
        m = pick(plan, rnd)
        assert m is not None
        m.in_flight += 1
    counts = sorted(m.in_flight for m in members)
    assert counts[-1] - counts[0] <= 8  # P2C keeps the spread small (random: ~±30)


def test_pick_excluding_skips_tried_members_and_falls_to_other_levels() -> None:
    plan = build_plan([status(A), status(B), status(C, 1)], 0.5)
    rnd = random.Random(0).random
    for _ in range(50):
        assert pick_excluding(plan, rnd, {A}) is B
    # primary only has a and b; with both tried, nothing: the secondary takes no traffic here
    assert pick_excluding(plan, rnd, {A, B}) is None
    plan2 = build_plan([status(A), status(B, available=False), status(C, 1)], 0.5)
    assert pick_excluding(plan2, rnd, {A}) is C


def test_sticky_keys_keep_their_member_and_move_only_when_it_goes() -> None:
    members = [M(f"m{i}") for i in range(5)]
    plan = build_plan([status(m) for m in members], 0.5)
    keys = [hash_key(f"user-{i}") for i in range(500)]
    first = {k: pick_sticky(plan, k) for k in keys}
    assert {k: pick_sticky(plan, k) for k in keys} == first  # deterministic
    assert len(Counter(first.values())) == 5  # spread over every member
    lost = members[2]
    plan2 = build_plan([status(m) for m in members if m is not lost], 0.5)
    moved = [k for k in keys if pick_sticky(plan2, k) is not first[k]]
    assert moved and all(first[k] is lost for k in moved)  # only the lost member's keys move


def test_split_sticky_is_stable_and_follows_weights() -> None:
    keys = [hash_key(f"u{i}") for i in range(4000)]
    picks = Counter(split_sticky([90, 10], k) for k in keys)
    assert picks[1] / 4000 == pytest.approx(0.1, abs=0.02)
    assert all(split_sticky([90, 10], k) == split_sticky([90, 10], k) for k in keys[:50])
    assert split_sticky([0, 0], keys[0]) is None
    assert {split_sticky([0, 5], k) for k in keys[:100]} == {1}


def test_hash_key_does_not_depend_on_the_process_hash_seed() -> None:
    import hashlib

    want = int.from_bytes(hashlib.blake2b(b"user-42", digest_size=8).digest(), "big")
    assert hash_key("user-42") == want
    assert hash_key("a") != hash_key("b")
