"""(compiled) Reading one string field of a protobuf message from its raw bytes, without its schema:
the model a KServe v2 / Triton `ModelInferRequest` (field 1, `model_name`) or Sluice's simulated
`InferRequest` (field 1, `model`) names, so that gRPC calls can be routed by model while the
proxy stays schema-free.

Pure. The wire format (https://protobuf.dev/programming-guides/encoding/): each field is a
varint key `(number << 3) | wire_type`, then a varint (type 0), 8 bytes (1), a varint length and
that many bytes (2) or 4 bytes (5); groups (3, 4) are obsolete and end the scan. Only the
top-level fields are walked, each skipped in O(1), so a large tensor payload costs nothing.
"""

from __future__ import annotations

from typing import Final

MAX_STRING: Final = 256  # a longer value is not a model name


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    """(value, next index); raises IndexError past the end or ValueError if over 10 bytes."""
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
        if shift >= 70:
            raise ValueError("varint too long")


def string_field(buf: bytes, number: int) -> str | None:
    """The first value of string field `number` (None: absent, malformed, not UTF-8, or longer
    than MAX_STRING bytes)."""
    i, n = 0, len(buf)
    try:
        while i < n:
            key, i = _varint(buf, i)
            wire, field = key & 7, key >> 3
            if wire == 0:
                _, i = _varint(buf, i)
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            elif wire == 2:
                size, i = _varint(buf, i)
                end = i + size
                if end > n:
                    return None
                if field == number:
                    if size > MAX_STRING:
                        return None
                    return buf[i:end].decode("utf-8")
                i = end
            else:
                return None
    except (IndexError, ValueError):  # UnicodeDecodeError is a ValueError
        return None
    return None
