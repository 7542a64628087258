"""The upstream request head (`gateway.upstream.request.encode_head`): byte for byte, and no CR or
LF smuggled into it from a header Sluice forwards (a claim, a client's value through HTTP/2)."""

from __future__ import annotations

import pytest

from gateway.upstream.request import encode_head


def test_the_head_is_the_request_line_one_line_per_header_the_framing_and_a_blank_line() -> None:
    headers = [(b"host", b"b:1"), (b"x-sluice-user", b"alice")]
    head = encode_head("POST", "/v1/chat", headers, b"content-length: 2\r\n")
    assert type(head) is bytes  # written as is (no copy), and never changed once made
    assert head == (
        b"POST /v1/chat HTTP/1.1\r\nhost: b:1\r\nx-sluice-user: alice\r\ncontent-length: 2\r\n\r\n"
    )
    assert encode_head("GET", "/", []) == b"GET / HTTP/1.1\r\n\r\n"
    assert encode_head("GET", "/?q=1", [(b"host", b"b:1")]) == (
        b"GET /?q=1 HTTP/1.1\r\nhost: b:1\r\n\r\n"
    )


@pytest.mark.parametrize(
    "name, value",
    [
        (b"x-sluice-user", b"alice\r\nx-admin: 1"),
        (b"x-sluice-user", b"alice\nx-admin: 1"),
        (b"x-sluice-user", b"alice\r"),
        (b"x-a\r\nx-admin", b"1"),
        (b"x-a\n", b"1"),
    ],
)
def test_a_cr_or_lf_anywhere_in_a_header_is_refused(name: bytes, value: bytes) -> None:
    headers = [(b"host", b"b:1"), (name, value), (b"accept", b"*/*")]
    with pytest.raises(ValueError, match="CR/LF in an upstream header"):
        encode_head("POST", "/v1/chat", headers)


@pytest.mark.parametrize("path", ["/a\r\nx: 1", "/a\n", "/a b"])
def test_a_cr_lf_or_space_in_the_target_is_refused(path: str) -> None:
    with pytest.raises(ValueError, match="request target"):
        encode_head("GET", path, [(b"host", b"b:1")])
