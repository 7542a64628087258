"""`sluice bench --full`'s paired feature costs (`gateway.bench.features`): the median of the
pairs' differences, their spread, and pairs with a failed run left out; and `--rounds`' ratios to
the floor (`gateway.bench.rounds`)."""

from __future__ import annotations

from gateway.bench.features import pair_cost, scaled_budget
from gateway.bench.rounds import ratio_note, rotated, row_target


def test_the_cost_is_the_median_of_the_pairs_differences() -> None:
    cost = pair_cost([50.0, 48.0, 53.0], [46.0, 45.5, 44.0])
    assert cost is not None
    assert (cost.median, cost.low, cost.high, cost.pairs) == (4.0, 2.5, 9.0, 3)
    assert "+4.0 µs/req, the median of 3 pairs" in cost.note("auth", "native", 3.0)
    assert cost.note("auth", "native", 3.0).endswith("budget ≤ 3: OVER")
    assert cost.note("auth", "native", 5.0).endswith("budget ≤ 5: within")


def test_a_pair_with_a_failed_run_is_left_out() -> None:
    cost = pair_cost([50.0, 0.0, 49.0], [45.0, 44.0, 0.0])
    assert cost is not None and (cost.median, cost.pairs) == (5.0, 1)
    assert pair_cost([0.0], [44.0]) is None


def test_with_the_runs_floor_the_budget_scales_with_it() -> None:
    """A budget is µs at the reference floor (17.6 µs): a machine whose floor costs twice as
    much gets twice the µs, and the verdict is read against that."""
    cost = pair_cost([50.0, 48.0, 53.0], [46.0, 45.5, 44.0])  # +4.0
    assert cost is not None
    assert scaled_budget(3.0, 35.2) == 6.0
    slow = cost.note("auth", "native", 3.0, floor_us=35.2)
    assert slow.endswith("budget ≤ 3 at a 17.6 µs floor = ≤ 6.0 at this run's 35.2: within")
    fast = cost.note("auth", "native", 3.0, floor_us=17.6)
    assert fast.endswith("= ≤ 3.0 at this run's 17.6: OVER")


def test_the_control_pair_reads_as_the_methods_own_spread() -> None:
    """`--features control`: the full chain against a second copy of itself has no budget, only
    its median and spread, the noise a feature's figure is read against."""
    cost = pair_cost([40.0, 41.5, 39.0], [39.5, 40.0, 39.8])
    assert cost is not None
    note = cost.control_note("native")
    assert note.startswith("control (the full chain against a second copy of itself, native)")
    assert "+0.5 µs/req, the median of 3 pairs (-0.8 … +1.5)" in note
    assert "budget" not in note


def test_rounds_turn_the_order_and_read_the_median_ratio_against_the_target() -> None:
    """`--rounds`: each round starts one run later, and a row's verdict is its median ratio to
    its floor in the same round."""
    assert [rotated([1, 2, 3], t) for t in range(4)] == [[1, 2, 3], [2, 3, 1], [3, 1, 2], [1, 2, 3]]
    note = ratio_note("HTTP Sluice (native)", [2.1, 1.9, 1.95, 2.4], 5, "the floor", 2.0)
    assert note == (
        "HTTP Sluice (native) ÷ the floor, in turn: 2.02×, the median of 4 of 5 rounds "
        "(1.90 … 2.40) vs target ≤ 2.0 → FAIL"
    )
    h2 = ratio_note("HTTP/2 Sluice (native)", [1.3, 1.4, 1.2], 3, "the HTTP/2 floor", 1.5)
    assert h2.startswith("HTTP/2 Sluice (native) ÷ the HTTP/2 floor, in turn: 1.30×")
    assert h2.endswith("→ PASS")
    assert "target" not in ratio_note("HTTP Sluice (aiohttp)", [1.5], 1, "the floor", None)
    assert "no round measured" in ratio_note("HTTP Sluice (native)", [], 3, "the floor", 2.0)
    assert row_target("HTTP Sluice (native, full chain)") == 3.0
    assert row_target("HTTP/2 Sluice (native)") == 1.5


def test_in_turn_pairs_each_run_with_its_floor_of_the_same_round() -> None:
    """A round's ratio uses that round's floor; a round whose floor or row failed is left out
    with a note; each round starts one run later."""
    from types import SimpleNamespace

    from gateway.bench.report import Row
    from gateway.bench.rounds import Run, in_turn

    floor = Run("gRPC Sluice (grpcio)", None, lambda d: [], lambda o, r: None, 1)
    row = Run("gRPC Sluice (h2)", floor.name, lambda d: [], lambda o, r: None, 2)
    cost = {  # (round, run) → µs per call; round 2's grpcio run failed
        (0, 1): 600.0, (0, 2): 360.0, (1, 1): 500.0, (1, 2): 350.0, (2, 2): 300.0,
        (3, 1): 640.0, (3, 2): 320.0,
    }  # fmt: skip
    order: list[str] = []
    rnd = iter(r // 2 for r in range(8))

    def measure(r: Row, cmd: object, parse: object, pid: int) -> Row:
        order.append(r.name)
        us = cost.get((next(rnd), pid))
        if us is None:
            r.error = "h2load failed"
        r.cpu_us_per_req = us
        return r

    s = SimpleNamespace(notes=[])
    ratios = in_turn(s, [floor, row], 4, measure)  # type: ignore[arg-type]
    assert ratios == {"gRPC Sluice (h2)": [0.6, 0.7, 0.5]}
    assert s.notes == ["rounds: gRPC Sluice (grpcio), round 3: h2load failed"]
    assert order[:4] == [f"rounds {n}" for n in (floor.name, row.name, row.name, floor.name)]
