"""The h2 gRPC engine's pure translations: grpc-timeout values and grpc-message encoding."""

from __future__ import annotations

import pytest
from hpack import NeverIndexedHeaderTuple

from gateway.adapters.h2.grpc import grpc_message, metadata_headers, parse_timeout


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("1H", 3600.0),
        ("2M", 120.0),
        ("3S", 3.0),
        ("250m", 0.25),
        ("1500u", 0.0015),
        ("99999999n", 0.099999999),
        ("0S", 0.0),
        ("123456789S", None),  # more than 8 digits
        ("10", None),  # no unit
        ("10s", None),  # units are case-sensitive
        ("S", None),
        ("-1S", None),
        ("1.5S", None),
        ("", None),
    ],
)
def test_parse_timeout(value: str, seconds: float | None) -> None:
    got = parse_timeout(value)
    if seconds is None:
        assert got is None
    else:
        assert got == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("details", "wire"),
    [
        ("plain text", b"plain text"),
        ("100%", b"100%25"),
        ("naïve", b"na%C3%AFve"),
        ("line\nbreak", b"line%0Abreak"),
        ("", b""),
    ],
)
def test_grpc_message_is_percent_encoded(details: str, wire: bytes) -> None:
    assert grpc_message(details) == wire


def test_binary_metadata_is_base64_without_padding() -> None:
    assert metadata_headers([("x-a-bin", b"\x00\xff"), ("x-t", "v")]) == [
        (b"x-a-bin", b"AP8"),
        (b"x-t", b"v"),
    ]


def test_the_overhead_figure_is_never_indexed() -> None:
    """New in every answer: kept out of the HPACK dynamic table (`codec.UNIQUE`)."""
    fields = metadata_headers([("x-sluice-overhead-ms", "0.120"), ("x-t", "v")])
    assert fields == [(b"x-sluice-overhead-ms", b"0.120"), (b"x-t", b"v")]
    assert isinstance(fields[0], NeverIndexedHeaderTuple)
    assert not isinstance(fields[1], NeverIndexedHeaderTuple)
