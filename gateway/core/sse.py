"""(compiled) Incremental Server-Sent Events parsing (the `text/event-stream` framing) with a
bounded line.

Pure: `feed(chunk)` returns the blocks completed by that chunk, each with its exact bytes
(`raw`), so a relay can pass them on unchanged, drop one, or end the stream after one. Blocks
without data (comments such as keep-alive pings) come back too, with `data == b""`. A line
longer than `max_line` makes the parser give up (`overflowed`): `take_rest()` returns what it
held, and the caller passes the rest of the stream through unparsed. Only `data:` and `event:`
fields are read (https://html.spec.whatwg.org/multipage/server-sent-events.html).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Final

DONE: Final = b"[DONE]"


@dataclass(frozen=True, slots=True)
class SseEvent:
    raw: bytes  # the block's bytes, blank line included
    data: bytes = b""  # the data lines joined with b"\n"
    event: str = ""

    @property
    def done(self) -> bool:
        return self.data == DONE


class SseParser:
    __slots__ = ("max_line", "_buf", "_raw", "_data", "_event", "overflowed")

    def __init__(self, max_line: int = 1 << 20) -> None:
        self.max_line = max_line
        self._buf = b""  # an incomplete line
        self._raw: list[bytes] = []  # complete lines of the block being read
        self._data: list[bytes] = []
        self._event = ""
        self.overflowed = False

    def feed(self, chunk: bytes) -> list[SseEvent]:
        if self.overflowed:
            return []
        buf = self._buf + chunk if self._buf else chunk
        out: list[SseEvent] = []
        start = 0
        raw = self._raw
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = buf[start:nl]
            raw.append(buf[start : nl + 1])
            start = nl + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                out.append(SseEvent(b"".join(raw), b"\n".join(self._data), self._event))
                raw.clear()
                self._data, self._event = [], ""
            elif line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
            elif line.startswith(b"event:"):
                self._event = line[6:].strip().decode("utf-8", "replace")
        self._buf = buf[start:]
        if len(self._buf) > self.max_line or sum((len(r) for r in raw), 0) > self.max_line:
            self.overflowed = True
        return out

    def take_rest(self) -> bytes:
        """The bytes held for an incomplete block (at the end of the stream, or after an
        overflow); the parser holds nothing afterwards."""
        rest = b"".join(self._raw) + self._buf
        self._raw, self._buf, self._data, self._event = [], b"", [], ""
        return rest


def error_event(error_type: str, message: str) -> bytes:
    """What ends a stream that cannot finish normally: an OpenAI-style error object in a final
    `data:` event, then `data: [DONE]`, so SDKs raise instead of waiting or truncating."""
    body = json.dumps(
        {"error": {"type": error_type, "message": message, "code": error_type}},
        separators=(",", ":"),
    )
    return b"data: " + body.encode() + b"\n\ndata: [DONE]\n\n"
