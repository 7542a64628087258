"""(compiled) LLM-token accounting of one request: reserve an estimate, watch the stream, settle.
Pure.

- At admission a request reserves `prompt tokens (prompt characters / 4) + max_tokens`, or the
  policy's default completion estimate when the body names no `max_tokens` (and for gRPC,
  whose bodies are not parsed).
- While an SSE stream runs, the completion tokens seen so far are counted from the chunks'
  text (a chunk counts at least one token: vLLM sends one token per chunk), so an overrun (more
  than reserved) can be seen before the stream ends.
- At the end the real usage (OpenAI `usage`, the final SSE usage chunk, or a gRPC trailer)
  settles the reservation: the difference is refunded or charged. Without a reported usage a
  stream is charged what was seen of it, an answer that never started is refunded in full, and
  anything else keeps its reservation.
"""

from __future__ import annotations

from typing import Any

from gateway.core.apis import output_chars
from gateway.core.body import CHARS_PER_TOKEN, Usage


def estimate(prompt_tokens: int, max_tokens: int | None, default_max_tokens: int) -> int:
    return prompt_tokens + (max_tokens if max_tokens is not None else default_max_tokens)


def chunk_tokens(doc: Any) -> int:
    """Completion tokens one streamed chunk carries (chat `delta.content`, completion `text`,
    a Responses or Messages event's delta), at least 1 for a chunk with text. 0 for anything
    else (usage-only chunk, role)."""
    if not isinstance(doc, dict):
        return 0
    choices = doc.get("choices")
    if not isinstance(choices, list):  # a Responses or Messages event
        chars = output_chars(doc)
        return max(1, chars // CHARS_PER_TOKEN) if chars else 0
    n = 0
    for c in choices:
        if not isinstance(c, dict):
            continue
        delta = c.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else c.get("text")
        if isinstance(text, str) and text:
            n += max(1, len(text) // CHARS_PER_TOKEN)
    return n


def usage_from_trailer(value: str) -> Usage | None:
    """A gRPC trailer carrying a call's total tokens as an integer."""
    try:
        total = int(value.strip())
    except ValueError:
        return None
    if total < 0:
        return None
    return Usage(0, total)


class Reservation:
    """One request's tokens: what it reserved, what the stream showed so far, what it used.

    `entries` holds what the caller needs to give the difference back to (one per limit rule
    with a token budget); this module only does the arithmetic."""

    __slots__ = ("reserved", "prompt", "streamed", "entries", "overrun", "settled")

    def __init__(self, reserved: int, prompt: int) -> None:
        self.reserved = reserved
        self.prompt = prompt  # the prompt part of the estimate
        self.streamed = 0  # completion tokens counted from SSE chunks
        self.entries: list[Any] = []
        self.overrun = False
        self.settled = False

    def on_chunk(self, doc: Any) -> bool:
        """Count a streamed chunk; True the first time the stream passes its reservation."""
        self.streamed += chunk_tokens(doc)
        if not self.overrun and self.prompt + self.streamed > self.reserved:
            self.overrun = True
            return True
        return False

    def used(self, usage: Usage | None, started: bool) -> int:
        """Tokens to charge in the end (see the module docstring)."""
        if usage is not None:
            return usage.total_tokens
        if self.streamed:
            return self.prompt + self.streamed
        if not started:
            return 0
        return self.reserved

    def difference(self, usage: Usage | None, started: bool) -> int:
        """reserved - used: > 0 to refund, < 0 to charge."""
        return self.reserved - self.used(usage, started)
