"""The tests' waiting helper (tests.support.wait_until / until): it returns the awaited value,
and a wait that times out says what it waited for and the last value it saw."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import pytest

from tests.support import Proc, until, wait_until


def test_returns_the_first_true_value() -> None:
    counter = itertools.count()
    assert wait_until(lambda: next(counter) >= 3 and "three", interval=0.001) == "three"


def test_ok_judges_the_observation_and_the_observation_is_returned() -> None:
    counter = itertools.count()
    assert wait_until(lambda: next(counter), ok=lambda n: n == 0) == 0  # a false value, accepted


def test_a_timeout_names_the_wait_and_the_last_value() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError) as e:
        wait_until(lambda: {"in_flight": 2}, 0.2, ok=lambda s: s["in_flight"] >= 6,
                   what="six streams in flight")  # fmt: skip
    assert time.monotonic() - started < 2
    assert str(e.value) == (
        "waited for six streams in flight: not within 0.2 s; last seen: {'in_flight': 2}"
    )


def test_without_what_the_source_of_the_check_is_named() -> None:
    with pytest.raises(AssertionError, match=r"waited for .*lambda: 1 \+ 1 == 3.*last seen: False"):
        wait_until(lambda: 1 + 1 == 3, 0.1)


def test_ignored_exceptions_are_not_yet_and_others_propagate() -> None:
    calls = itertools.count()

    def flaky() -> int:
        if next(calls) < 2:
            raise ConnectionRefusedError("starting")
        return 7

    def down() -> int:
        raise ConnectionRefusedError("still starting")

    assert wait_until(flaky, interval=0.001, ignore=(OSError,)) == 7
    with pytest.raises(AssertionError, match=r"last seen: nothing, then ConnectionRefusedError\("):
        wait_until(down, 0.1, ignore=(OSError,))
    values = iter([5])

    def up_then_down() -> int:
        return next(values, None) or down()

    with pytest.raises(AssertionError, match=r"seen: 5, then ConnectionRefusedError\('still"):
        wait_until(up_then_down, 0.1, ok=lambda n: n > 5, ignore=(OSError,))
    with pytest.raises(KeyError):
        wait_until(lambda: dict[str, int]()["missing"])


def test_a_watched_process_that_exits_ends_the_wait_with_its_log(tmp_path: Path) -> None:
    proc = Proc(["--no-such-command"], tmp_path / "out.log")
    try:
        started = time.monotonic()
        with pytest.raises(
            AssertionError,
            match=r"(?s)the process exited \(2\); last seen: False\n--- .*usage: sluice",
        ):
            wait_until(lambda: False, 30, proc=proc, what="never")
        assert time.monotonic() - started < 20
    finally:
        proc.stop()


async def test_the_async_form_lets_the_loop_run() -> None:
    done: list[int] = []

    async def later() -> None:
        await asyncio.sleep(0.05)
        done.append(1)

    task = asyncio.ensure_future(later())
    assert await until(lambda: len(done), interval=0.01) == 1
    await task
    with pytest.raises(AssertionError, match="waited for nothing: not within 0.05 s; last seen: 0"):
        await until(lambda: len(done) - 1, 0.05, what="nothing")
