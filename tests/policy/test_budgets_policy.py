"""The budgets policy validates as Sluice documents it (the shape in policies/examples/
budgets.yaml), its mistakes point at their line and column, and `policy check` says when
budgets have no store."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.budgets.compiled import compile_budgets
from gateway.cli import main
from gateway.policy.compiled import compile_policy
from gateway.policy.loader import load_policy
from tests.policy.test_backends_policy import load
from tests.support import ROOT

EXAMPLE = ROOT / "policies" / "examples" / "budgets.yaml"


def test_the_example_validates_and_compiles() -> None:
    p = compile_policy(load_policy(EXAMPLE)).policy
    assert p.store is not None and p.store.redis.url == "redis://redis:6379/0"
    assert p.budgets is not None
    c = compile_budgets(p.budgets)
    month, day = c.rules
    assert (
        month.name == "team-month" and month.tokens == 50_000_000 and month.claim == "budget_tokens"
    )
    assert month.period.calendar == "month" and month.warn_at == (0.8, 0.95) and not month.closed
    assert month.cost.of(None, 10, 10) == 40
    assert day.closed and day.period.timezone == "Europe/Paris"
    assert month.limit("acme", {"budget_tokens": "1234"}, {}) == 1234
    assert month.limit("acme", {"budget_tokens": "many"}, {}) == 50_000_000
    assert month.limit("acme", {"budget_tokens": -3}, {}) == 50_000_000
    assert month.limit("acme", None, {}) == 50_000_000


BASE = """\
backends:
  - name: b
    endpoints: [{{address: "127.0.0.1:1"}}]
routes:
  - {{name: r, backend: b}}
budgets:
  rules:
    - name: t
      key: [claim:team]
{rule}"""


@pytest.mark.parametrize(
    ("rule", "error"),
    [
        ("      tokens: 10\n      period: {calendar: year}\n",
         "11:26: budgets.rules[0].period.calendar: Input should be 'day', 'week' or 'month'"),
        ("      tokens: 10\n      period: {rolling: 10y}\n",
         "11:25: budgets.rules[0].period.rolling: '10y' is not a duration"),
        ("      tokens: 10\n      period: {calendar: day, timezone: Mars/Olympus}\n",
         "11:41: budgets.rules[0].period.timezone: unknown time zone"),
        ("      tokens: 10\n      period: {calendar: day, rolling: 1d}\n",
         "11:15: budgets.rules[0].period: a period is either"),
        ("      tokens: 0\n      period: {rolling: 1d}\n",
         "10:15: budgets.rules[0].tokens: Input should be greater than 0"),
        ("      tokens: 10\n      period: {rolling: 1d}\n      warn_at: [0.5, 1.2]\n",
         "12:16: budgets.rules[0].warn_at: warn_at fractions lie between 0 and 1"),
        ("      tokens: 10\n      period: {rolling: 1d}\n      amounts: {from: claim:a, file: x}\n",
         "12:16: budgets.rules[0].amounts: amounts takes either"),
        ("      tokens: 10\n      period: {rolling: 1d}\n      when_store_down: maybe\n",
         "12:24: budgets.rules[0].when_store_down: Input should be 'open' or 'closed'"),
        ("      tokens: 10\n      period: {rolling: 1d}\n      cost: {inptu: 2}\n",
         "12:14: budgets.rules[0].cost.inptu: unknown field; did you mean 'input'?"),
    ],
)  # fmt: skip
def test_mistakes_point_at_their_field(tmp_path: Path, rule: str, error: str) -> None:
    errors = load(tmp_path, BASE.format(rule=rule))
    assert errors and errors[0].startswith(error), errors


def test_model_key_and_missing_filter(tmp_path: Path) -> None:
    text = BASE.format(rule="      tokens: 10\n      period: {rolling: 1d}\n").replace(
        "[claim:team]", "[model]"
    )
    errors = load(tmp_path, text)
    assert errors and "9:12: budgets.rules[0].key: a budget is keyed before" in errors[0]
    text = "filters: [auth, ratelimit, route]\n" + BASE.format(
        rule="      tokens: 10\n      period: {rolling: 1d}\n"
    )
    assert load(tmp_path, text) == [
        "1:10: filters: budgets are configured: list 'budget' in filters"
    ]


def test_policy_check_says_when_budgets_have_no_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(BASE.format(rule="      tokens: 10\n      period: {calendar: day}\n"))
    assert main(["policy", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{path}:7:3: warning: budgets: no top-level `store`: budgets live in memory per" in out
    path.write_text("store: {redis: {url: 'redis://127.0.0.1:1/0'}}\n" + path.read_text())
    assert main(["policy", "check", str(path)]) == 0
    assert "warning" not in capsys.readouterr().out


def test_amounts_file_is_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    amounts = tmp_path / "amounts.yaml"
    amounts.write_text("acme: 100\nbeta: lots\n")
    path = tmp_path / "p.yaml"
    rule = (
        f"      tokens: 10\n      period: {{calendar: day}}\n      amounts: {{file: {amounts}}}\n"
    )
    path.write_text(BASE.format(rule=rule))
    assert main(["policy", "check", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"{path}:12:23: budgets.rules[0].amounts.file: {amounts}: 'beta': a budget is" in out
    amounts.write_text("acme: 100\n")
    assert main(["policy", "check", str(path)]) == 0
    p = load_policy(path)
    assert p.budgets is not None
    (r,) = compile_budgets(p.budgets).rules
    assert r.limit("acme", None, {}) == 100 and r.limit("other", None, {}) == 10
