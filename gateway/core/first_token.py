"""(compiled) What a streamed answer's events say before its first token: still the preamble (the
head, a role-only chunk, keep-alive comments), content (the answer has begun: from here on it is
never retried), the end, or an error the backend sent instead of an answer.

Pure: events come from `gateway.core.sse`, their JSON parsed by the caller. Used by the
forwarding path to hold a stream's start until its first content (`retries.before_first_token`)
and retry on another member when the backend fails first.
"""

from __future__ import annotations

import enum
import json
from typing import Any, Final

from gateway.core.sse import SseEvent


class Seen(enum.Enum):
    PREAMBLE = "preamble"  # nothing of the answer yet: may still be retried
    CONTENT = "content"  # the answer began (a token, a tool call, a finish)
    END = "end"  # [DONE]: the stream ended
    ERROR = "error"  # the backend sent an error instead of an answer


_CONTENT_KEYS: Final = ("content", "tool_calls", "function_call", "reasoning_content", "refusal")


def classify(ev: SseEvent) -> Seen:
    if ev.done:
        return Seen.END
    if ev.event == "error":
        return Seen.ERROR
    if not ev.data:
        return Seen.PREAMBLE  # a comment (keep-alive)
    try:
        doc = json.loads(ev.data)
    except ValueError:
        return Seen.CONTENT  # not OpenAI JSON: whatever it is, it is the answer
    return classify_doc(doc)


# Responses and Messages stream events by `type` (OpenAI chunks have none). The output events
# (`response.*.delta`, `content_block_delta`) and the ends are content; anything else of
# theirs not named here (a `response.*.done`...) is content too.
_TYPED: Final = {
    "response.created": Seen.PREAMBLE,
    "response.in_progress": Seen.PREAMBLE,
    "response.queued": Seen.PREAMBLE,
    "response.output_item.added": Seen.PREAMBLE,
    "response.content_part.added": Seen.PREAMBLE,
    "response.failed": Seen.ERROR,
    "message_start": Seen.PREAMBLE,
    "content_block_start": Seen.PREAMBLE,
    "ping": Seen.PREAMBLE,
    "error": Seen.ERROR,
}


def classify_doc(doc: Any) -> Seen:
    if not isinstance(doc, dict):
        return Seen.CONTENT
    if doc.get("error") is not None or doc.get("object") == "error":
        return Seen.ERROR
    t = doc.get("type")
    if t is not None and isinstance(t, str):
        return _TYPED.get(t, Seen.CONTENT)
    choices = doc.get("choices")
    if not isinstance(choices, list):
        return Seen.PREAMBLE if "usage" in doc else Seen.CONTENT
    for c in choices:
        if not isinstance(c, dict):
            continue
        if c.get("finish_reason") is not None or c.get("text"):
            return Seen.CONTENT
        delta = c.get("delta")
        if isinstance(delta, dict) and any(delta.get(k) for k in _CONTENT_KEYS):
            return Seen.CONTENT
    return Seen.PREAMBLE
