"""Incremental Server-Sent Events parsing (the `text/event-stream` framing) with a bounded line.

Pure: `feed(chunk)` returns the events completed by that chunk. A line longer than `max_line`
makes the parser give up (`overflowed`): the stream still passes through byte for byte, only
events are no longer reported. Only `data:` and `event:` fields matter here; comments and
other fields are ignored (https://html.spec.whatwg.org/multipage/server-sent-events.html).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

DONE = b"[DONE]"


@dataclass(frozen=True, slots=True)
class SseEvent:
    data: bytes  # the data lines joined with b"\n"
    event: str = ""

    @property
    def done(self) -> bool:
        return self.data == DONE


class SseParser:
    __slots__ = ("max_line", "_buf", "_data", "_event", "overflowed")

    def __init__(self, max_line: int = 1 << 20) -> None:
        self.max_line = max_line
        self._buf = b""
        self._data: list[bytes] = []
        self._event = ""
        self.overflowed = False

    def feed(self, chunk: bytes) -> list[SseEvent]:
        if self.overflowed:
            return []
        buf = self._buf + chunk if self._buf else chunk
        out: list[SseEvent] = []
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = buf[start:nl]
            start = nl + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    out.append(SseEvent(b"\n".join(self._data), self._event))
                self._data, self._event = [], ""
            elif line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
            elif line.startswith(b"event:"):
                self._event = line[6:].strip().decode("utf-8", "replace")
        self._buf = buf[start:]
        if len(self._buf) > self.max_line or sum(len(d) for d in self._data) > self.max_line:
            self.overflowed = True
            self._buf, self._data = b"", []
        return out


def error_event(error_type: str, message: str) -> bytes:
    """What ends a stream that cannot finish normally: an OpenAI-style error object in a final
    `data:` event, then `data: [DONE]`, so SDKs raise instead of waiting or truncating."""
    body = json.dumps(
        {"error": {"type": error_type, "message": message, "code": error_type}},
        separators=(",", ":"),
    )
    return b"data: " + body.encode() + b"\n\ndata: [DONE]\n\n"
