from __future__ import annotations

from typing import Any

import pytest

from gateway.core.body import Usage
from gateway.core.tokens import Reservation, chunk_tokens, estimate, usage_from_trailer


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "default", "expected"),
    [(10, 100, 1024, 110), (10, None, 1024, 1034), (0, 0, 1024, 0)],
)
def test_estimate(prompt: int, max_tokens: int | None, default: int, expected: int) -> None:
    assert estimate(prompt, max_tokens, default) == expected


@pytest.mark.parametrize(
    ("doc", "n"),
    [
        ({"choices": [{"delta": {"content": "hi"}}]}, 1),
        ({"choices": [{"delta": {"content": "x" * 40}}]}, 10),
        ({"choices": [{"text": "word"}]}, 1),  # text completion
        ({"choices": [{"delta": {"role": "assistant"}}]}, 0),
        ({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}, 0),
        ({"choices": [{"delta": {"content": "a"}}, {"delta": {"content": "b"}}]}, 2),
        (None, 0),
        ("[DONE]", 0),
    ],
)
def test_chunk_tokens(doc: Any, n: int) -> None:
    assert chunk_tokens(doc) == n


def test_overrun_is_reported_once_when_the_stream_passes_its_reservation() -> None:
    r = Reservation(reserved=12, prompt=10)
    chunk = {"choices": [{"delta": {"content": "tok"}}]}
    assert [r.on_chunk(chunk) for _ in range(4)] == [False, False, True, False]
    assert r.streamed == 4 and r.overrun


@pytest.mark.parametrize(
    ("usage", "streamed", "started", "used"),
    [
        (Usage(7, 20), 0, True, 27),  # the backend's numbers win
        (Usage(7, 20), 5, True, 27),
        (None, 5, True, 15),  # a stream without usage: the prompt estimate + what was seen
        (None, 0, False, 0),  # never started: refunded in full
        (None, 0, True, 110),  # answered, no usage: the reservation stands
    ],
)
def test_used_and_difference(usage: Usage | None, streamed: int, started: bool, used: int) -> None:
    r = Reservation(reserved=110, prompt=10)
    r.streamed = streamed
    assert r.used(usage, started) == used
    assert r.difference(usage, started) == 110 - used


@pytest.mark.parametrize(("value", "total"), [("42", 42), (" 7 ", 7), ("x", None), ("-1", None)])
def test_usage_from_trailer(value: str, total: int | None) -> None:
    u = usage_from_trailer(value)
    assert (u.total_tokens if u else None) == total
