"""One key's decisions with a manual clock: window, bucket, pressure, colour, reset, undo."""

from __future__ import annotations

import pytest

from gateway.core.keystate import Code, KeyState, RuleMath, strict_seen
from gateway.core.overload import Colour

QPS5 = RuleMath.of(qps=5, window_s=1.0, rate=None, burst=None)
QPS100 = RuleMath.of(qps=100, window_s=1.0, rate=None, burst=None)
TOK = RuleMath.of(qps=None, window_s=1.0, rate=10, burst=100)
BOTH = RuleMath.of(qps=10, window_s=1.0, rate=100, burst=100)


def run(m: RuleMath, n: int, dt: float, t0: float = 10.0, cost: float = 0.0, scale: float = 1.0):
    ks = KeyState(m, scale, t0)
    codes = []
    t = t0
    for _ in range(n):
        code = ks.request(m, scale, t)
        if code is Code.ADMIT and cost:
            assert ks.reserve(m, scale, t, cost)
        codes.append(code)
        t += dt
    return ks, codes


@pytest.mark.parametrize(
    ("m", "n", "dt", "cost", "admitted", "first_refusal"),
    [
        (QPS5, 8, 0.01, 0, 5, Code.QPS),  # a small limit: the window decides
        (QPS100, 120, 0.001, 0, 95, Code.PRESSURE),  # one signal: admitted up to 95 %
        (QPS5, 20, 0.25, 0, 20, None),  # 4/s under 5/s: all pass
        (TOK, 6, 0.0, 30, 4, Code.TOKENS),  # 100 -> 70 -> 40 -> 10 -> -20 (debt) -> empty
        (TOK, 5, 0.0, 24, 4, Code.PRESSURE),  # 4 left of 100: utilisation 0.96 >= 0.95
    ],
)
def test_decisions(
    m: RuleMath, n: int, dt: float, cost: float, admitted: int, first_refusal: Code | None
) -> None:
    _, codes = run(m, n, dt, cost=cost)
    assert codes.count(Code.ADMIT) == admitted
    refused = [c for c in codes if c is not Code.ADMIT]
    assert (refused[0] if refused else None) is first_refusal


def test_scale_gives_each_worker_its_share() -> None:
    _, codes = run(QPS100, 100, 0.0001, scale=0.5)
    assert codes.count(Code.ADMIT) == 48  # 95 % of 50


def test_refused_requests_do_not_lock_the_client_out() -> None:
    ks, codes = run(QPS5, 50, 0.02)  # 50/s offered for a second against 5/s
    assert codes.count(Code.ADMIT) == 5
    t = 10.0 + 50 * 0.02 + 1.0  # a window later, with no more arrivals
    assert ks.request(QPS5, 1.0, t) is Code.ADMIT


def test_colour_follows_offered_demand_not_admissions() -> None:
    m = BOTH
    ks = KeyState(m, 1.0, 0.0)
    t, seen = 0.0, []
    for _ in range(40):  # 40/s against 10/s, tokens untouched
        ks.request(m, 1.0, t)
        seen.append(ks.colour)
        t += 0.025
    assert Colour.YELLOW in seen and Colour.RED not in seen  # tokens are fine: never red
    for _ in range(200):  # now also drain the bucket: both signals high -> red
        if ks.request(m, 1.0, t) is Code.ADMIT:
            ks.reserve(m, 1.0, t, 50.0)
        t += 0.025
    assert ks.colour is Colour.RED
    ks.request(m, 1.0, t + 30.0)  # demand gone, bucket refilled
    assert ks.colour is Colour.GREEN


def test_entering_red_forgives_the_token_debt() -> None:
    m = BOTH
    ks = KeyState(m, 1.0, 0.0)
    ks.bucket.tokens = -80.0
    ks.win.ocur = 20.0  # offered 2x the limit in this window
    ks.win.idx = 0
    assert ks.request(m, 1.0, 0.5) is Code.TOKENS
    assert ks.colour is Colour.RED and ks.changed is Colour.GREEN
    assert ks.bucket.tokens >= 0.0 and ks.reset


def test_undo_gives_the_admission_back() -> None:
    ks, codes = run(QPS5, 5, 0.0)
    assert codes == [Code.ADMIT] * 5
    ks.undo()
    assert ks.request(QPS5, 1.0, 10.0) is Code.ADMIT


def test_settle_refunds_and_charges() -> None:
    ks = KeyState(TOK, 1.0, 0.0)
    assert ks.reserve(TOK, 1.0, 0.0, 60.0)
    ks.settle(TOK, 1.0, 50.0)  # used 10 of 60
    assert ks.bucket.tokens == pytest.approx(90.0)
    ks.settle(TOK, 1.0, -150.0)  # used far more than reserved
    assert ks.bucket.tokens == pytest.approx(-60.0)
    assert ks.request(TOK, 1.0, 0.0) is Code.TOKENS
    assert ks.retry_after(TOK, 1.0, 0.0, Code.TOKENS) == pytest.approx(6.0, abs=0.01)


def test_idle_keys_recolour_when_observed() -> None:
    ks, _ = run(QPS5, 30, 0.01)
    assert ks.colour is Colour.YELLOW
    assert ks.observe(QPS5, 1.0, 20.0) and ks.colour is Colour.GREEN


def test_strict_seen_moves_the_colour_from_the_store_picture() -> None:
    ks = KeyState(BOTH, 1.0, 0.0)
    strict_seen(ks, BOTH, 1.0, False, 10.0, 20.0, -5.0)
    assert ks.colour is Colour.RED and ks.win.ocur == 1 and ks.win.cur == 0


def test_window_of_a_slow_rule_holds_one_request() -> None:
    m = RuleMath.of(qps=0.5, window_s=1.0, rate=None, burst=None)
    assert m.window_s == 2.0 and m.limit == 1.0
    _, codes = run(m, 3, 0.5)
    assert codes.count(Code.ADMIT) == 1
