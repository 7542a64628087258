"""(compiled) W3C Trace Context (https://www.w3.org/TR/trace-context/): parse and render
`traceparent`.

Pure. `parse` accepts version 00 exactly as the spec fixes it (55 characters) and later
versions by their first four fields (the spec's forward-compatibility rule); an all-zero trace
or parent id, or version ff, makes the header invalid (the caller then starts a new trace).
`tracestate` is opaque to Sluice: it travels on untouched with the client's other headers.
"""

from __future__ import annotations

from typing import Final

MASK64: Final = (1 << 64) - 1
_HEX: Final = frozenset("0123456789abcdef")


def parse(value: str) -> tuple[int, int, int] | None:
    """`(trace_id, parent_span_id, flags)`, or None for a header that is not valid."""
    value = value.strip()
    if len(value) < 55 or value[2] != "-" or value[35] != "-" or value[52] != "-":
        return None
    version = value[:2]
    if version == "00":
        if len(value) != 55:
            return None
    elif version == "ff" or (len(value) > 55 and value[55] != "-"):
        return None
    head = value[:55]
    if not _HEX.issuperset(head[:2] + head[3:35] + head[36:52] + head[53:55]):
        return None  # also refuses upper case, which the spec forbids
    trace_id = int(head[3:35], 16)
    span_id = int(head[36:52], 16)
    if trace_id == 0 or span_id == 0:
        return None
    return trace_id, span_id, int(head[53:55], 16)


def render(trace_id: int, span_id: int, flags: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


def client_span_id(server_span_id: int, attempt: int) -> int:
    """The span id of upstream try `attempt` (0-based): derived from the server span's, so the
    `traceparent` sent to the backend and the client span built later agree without storing
    ids per try. Unique within the trace (span ids need be no more than that)."""
    return (server_span_id + attempt) % MASK64 + 1  # 1 .. 2^64-1, never 0, wraps past the top
