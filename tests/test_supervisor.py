"""The supervisor's back-off and how it names a worker's end (pure; real processes are in
tests/integration/test_supervisor.py)."""

from __future__ import annotations

import signal

import pytest

from gateway.supervisor import FIRST_BACKOFF_S, MAX_BACKOFF_S, STABLE_S, ended, next_backoff


@pytest.mark.parametrize(
    ("previous", "up", "expected"),
    [
        (0.0, 0.5, FIRST_BACKOFF_S),  # the first death of a first-generation worker
        (0.0, STABLE_S * 2, FIRST_BACKOFF_S),
        (FIRST_BACKOFF_S, 0.5, 2 * FIRST_BACKOFF_S),  # a replacement that died young
        (0.4, 0.5, 0.8),
        (MAX_BACKOFF_S, 0.5, MAX_BACKOFF_S),  # bounded
        (20.0, 1.0, MAX_BACKOFF_S),
        (MAX_BACKOFF_S, STABLE_S, FIRST_BACKOFF_S),  # stayed up a while: start again
    ],
)
def test_backoff_doubles_while_workers_die_young(
    previous: float, up: float, expected: float
) -> None:
    assert next_backoff(previous, up) == pytest.approx(expected)


def test_a_crash_loop_waits_more_and_more() -> None:
    delays, previous = [], 0.0
    for _ in range(12):
        previous = next_backoff(previous, 0.1)
        delays.append(previous)
    assert delays[:4] == pytest.approx([0.1, 0.2, 0.4, 0.8])
    assert sum(delays) > 60 and max(delays) == MAX_BACKOFF_S


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (-signal.SIGKILL, "killed by SIGKILL"),
        (-signal.SIGSEGV, "killed by SIGSEGV"),
        (1, "exited with status 1"),
        (0, "exited with status 0"),
    ],
)
def test_ended(code: int, text: str) -> None:
    assert ended(code) == text
