"""What a stream's events say before its first token, and the retry rule with
before_first_token: table-driven, pure."""

from __future__ import annotations

import pytest

from gateway.core.first_token import Seen, classify
from gateway.core.outcome import Outcome
from gateway.core.retry import RetryParams, retriable
from gateway.core.sse import SseEvent


def ev(data: bytes, event: str = "") -> SseEvent:
    return SseEvent(b"", data, event)


@pytest.mark.parametrize(
    ("event", "want"),
    [
        (ev(b'{"choices":[{"delta":{"role":"assistant","content":""}}]}'), Seen.PREAMBLE),
        (ev(b'{"choices":[{"delta":{"content":"Hi"}}]}'), Seen.CONTENT),
        (ev(b'{"choices":[{"delta":{"tool_calls":[{"id":"t"}]}}]}'), Seen.CONTENT),
        (ev(b'{"choices":[{"delta":{},"finish_reason":"stop"}]}'), Seen.CONTENT),
        (ev(b'{"choices":[{"text":"a","finish_reason":null}]}'), Seen.CONTENT),
        (ev(b'{"choices":[{"text":"","finish_reason":null}]}'), Seen.PREAMBLE),
        (ev(b'{"choices":[],"usage":null}'), Seen.PREAMBLE),
        (ev(b'{"usage":{"prompt_tokens":1}}'), Seen.PREAMBLE),
        (ev(b'{"error":{"message":"boom"}}'), Seen.ERROR),
        (ev(b'{"object":"error","message":"boom"}'), Seen.ERROR),
        (ev(b"x", "error"), Seen.ERROR),
        (ev(b""), Seen.PREAMBLE),  # a keep-alive comment
        (ev(b"[DONE]"), Seen.END),
        (ev(b"plain text"), Seen.CONTENT),
    ],
)
def test_classify(event: SseEvent, want: Seen) -> None:
    assert classify(event) is want


@pytest.mark.parametrize(
    ("outcome", "status", "responded", "before", "want"),
    [
        (Outcome.UPSTREAM_PROTOCOL, 0, False, True, True),
        (Outcome.UPSTREAM_PROTOCOL, 0, False, False, False),
        (Outcome.UPSTREAM_TIMEOUT, 0, False, True, True),
        (Outcome.UPSTREAM_ERROR, 500, False, True, True),
        (Outcome.UPSTREAM_ERROR, 500, False, False, False),
        (Outcome.UPSTREAM_ERROR, 500, True, True, False),  # content reached the client: never
        (Outcome.CLIENT_CANCELLED, 0, False, True, False),
        (Outcome.UPSTREAM_CONNECT, 0, False, False, True),
    ],
)
def test_retriable_before_the_first_token(
    outcome: Outcome, status: int, responded: bool, before: bool, want: bool
) -> None:
    p = RetryParams(before_first_token=before)
    assert retriable(p, outcome, status, None, responded) is want
