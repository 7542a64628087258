"""The model name of a raw protobuf message, read without its schema: table-driven, checked
against messages protobuf itself encodes."""

from __future__ import annotations

import pytest

from gateway.core.protowire import string_field
from gateway.proto import load

pb2, _ = load()


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        (pb2.InferRequest(model="llama-3", prompt="hi", max_tokens=3).SerializeToString(),
         "llama-3"),
        (pb2.InferRequest(max_tokens=300, prompt="x" * 5000, model="m").SerializeToString(), "m"),
        (pb2.InferRequest(prompt="hi").SerializeToString(), None),  # no model
        (b"\x0a\x03abc", "abc"),
        (b"\x08\x96\x01\x0a\x01z", "z"),  # a varint field first
        (b"\x11" + b"\0" * 8 + b"\x0a\x01y", "y"),  # fixed64 first
        (b"\x15" + b"\0" * 4 + b"\x0a\x01y", "y"),  # fixed32 first
        (b"\x0a\x05ab", None),  # cut short
        (b"\x0a\x02\xff\xfe", None),  # not UTF-8
        (b"\x0a" + bytes([0x81, 0x02]) + b"a" * 257, None),  # over MAX_STRING
        (b"\x0b\x0a\x01y", None),  # a group: not walked
        (b"\x08" + b"\xff" * 11, None),  # a runaway varint
        (b"", None),
    ],
)  # fmt: skip
def test_string_field(raw: bytes, want: str | None) -> None:
    assert string_field(raw, 1) == want
