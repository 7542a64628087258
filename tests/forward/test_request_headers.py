"""The upstream request's headers (`gateway.forward.headers.request_headers`): hop-by-hop and
Connection-listed fields dropped, X-Forwarded-* made, a filter's header replacing the client's,
in any case the client spells the names, and the same the second time a spelling is seen (the
lowercased names are learned by the name as sent, long names are not)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gateway.context import RequestContext
from gateway.forward.headers import request_headers
from gateway.policy.compiled import Endpoint
from tests.forward.heads import SPELLINGS, request_context

UPSTREAM = Endpoint("b", "http", "10.1.2.3", 8000, 1)
LONG = "X-" + "Very-Long-Header-Name-" * 5  # past what is learned


def ctx(extra: dict[str, str] | None = None) -> RequestContext:
    c = request_context()
    c.upstream_headers.update(extra or {})
    return c


@pytest.mark.parametrize("case", SPELLINGS)
def test_dropped_made_and_replaced_in_any_case(case: Callable[[str], str]) -> None:
    def name(s: str) -> bytes:
        return case(s).encode()

    client = [
        (name("Host"), b"gateway.example"),
        (name("Connection"), b"keep-alive, X-Hop"),
        (name("X-Hop"), b"1"),
        (name("Keep-Alive"), b"timeout=5"),
        (name("Content-Length"), b"2"),
        (name("X-Forwarded-For"), b"192.0.2.7"),
        (name("X-Tenant"), b"spoofed"),
        (name(LONG), b"kept"),
        (name("Content-Type"), b"application/json"),
    ]
    for _ in range(2):  # the second time, by the names learned from the first
        out = request_headers(client, ctx({"x-tenant": "t1", "x-claim": ""}), UPSTREAM)
        assert out == [
            (b"host", b"10.1.2.3:8000"),
            (name(LONG), b"kept"),
            (name("Content-Type"), b"application/json"),
            (b"x-forwarded-for", b"192.0.2.7, 10.0.0.1"),
            (b"x-forwarded-proto", b"http"),
            (b"x-tenant", b"t1"),  # the filter's value; an empty one only strips the client's
        ]


def test_a_connection_listed_long_name_is_dropped_too() -> None:
    client = [(b"Connection", LONG.upper().encode()), (LONG.encode(), b"hop"), (b"Accept", b"*/*")]
    for _ in range(2):
        out = request_headers(client, ctx(), UPSTREAM)
        assert [n for n, _ in out] == [b"host", b"Accept", b"x-forwarded-for", b"x-forwarded-proto"]


def test_the_filters_names_are_learned_and_their_empty_values_only_strip() -> None:
    import gateway.forward.headers as headers

    long_filter_name = "x-" + "claim-" * 12  # past what is learned
    extra = {"x-user": "u1", "x-claim": "", long_filter_name: "v"}
    client = [(b"X-Claim", b"spoofed"), (b"X-User", b"spoofed"), (b"Accept", b"*/*")]
    for _ in range(2):  # the second time, by the names learned from the first
        out = request_headers(client, ctx(extra), UPSTREAM)
        assert out == [
            (b"host", b"10.1.2.3:8000"),
            (b"Accept", b"*/*"),
            (b"x-forwarded-for", b"10.0.0.1"),
            (b"x-forwarded-proto", b"http"),
            (b"x-user", b"u1"),
            (long_filter_name.encode(), b"v"),
        ]
    learned = headers._NAME_BYTES
    assert learned["x-user"] == b"x-user" and learned["x-claim"] == b"x-claim"
    assert long_filter_name not in learned
