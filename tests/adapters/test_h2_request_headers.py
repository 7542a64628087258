"""`request_headers` against h2's own check: the single pass makes the decisions of
`validate_headers` (a request received by a server) on the same values stripped of surrounding
spaces and tabs, over valid requests, each rule's breaches and a seeded fuzz."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from h2.exceptions import ProtocolError
from h2.utilities import HeaderValidationFlags, validate_headers
from hpack.struct import HeaderTuple, NeverIndexedHeaderTuple

from gateway.adapters.h2 import guard
from gateway.adapters.h2.guard import request_headers

Headers = list[tuple[bytes, bytes]]
FLAGS = HeaderValidationFlags(
    is_client=False, is_trailer=False, is_response_header=False, is_push_promise=False
)


def h2_check(raw: Headers, errors: set[str] | None = None) -> Headers | None:
    """The check as the engine ran it before: values stripped, then h2's generator chain."""
    ws = (b" ", b"\t")
    cleaned = [(n, v.strip(b" \t")) if v[:1] in ws or v[-1:] in ws else (n, v) for n, v in raw]
    try:
        return list(validate_headers(cleaned, FLAGS))
    except ProtocolError as e:
        if errors is not None:
            errors.add(str(e))
        return None


def agree(raw: Headers, errors: set[str] | None = None) -> bool:
    """True when the block is accepted; fails the test if the two checks differ."""
    want = h2_check(raw, errors)
    got = request_headers(raw)
    assert got == want, raw
    assert got is None or all(type(h) is tuple for h in got), raw
    return got is not None


A = b"example.com"
GET: Headers = [
    (b":method", b"GET"),
    (b":scheme", b"https"),
    (b":authority", A),
    (b":path", b"/v1/models?x=1"),
    (b"user-agent", b"curl/8.5.0"),
    (b"accept", b"*/*"),
]
CHAT: Headers = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":path", b"/v1/chat/completions"),
    (b":authority", b"localhost:8080"),
    (b"content-type", b"application/json"),
    (b"authorization", b"Bearer sk-test-0123456789abcdef"),
    (b"content-length", b"187"),
    (b"accept-encoding", b"gzip, deflate, br"),
    (b"user-agent", b"OpenAI/Python 1.40.0"),
    (b"x-request-id", b"8f14e45f-ceea-467f-a0e6-1b4c8d1e6a2b"),
    (b"cookie", b"session=abc; theme=dark"),
]
GRPC: Headers = [
    (b":scheme", b"http"),
    (b":method", b"POST"),
    (b":authority", b"localhost:50051"),
    (b":path", b"/sluice.test.Echo/Unary"),
    (b"te", b"trailers"),
    (b"content-type", b"application/grpc"),
    (b"user-agent", b"grpc-python-asyncio/1.62.1 grpc-c/39.0.0 (linux; chttp2)"),
    (b"grpc-accept-encoding", b"identity, deflate, gzip"),
    (b"grpc-timeout", b"4999912u"),
    (b"authorization", b"Bearer t"),
    (b"x-tenant-bin", b"\x01\x02\xff"),
]
CONNECT: Headers = [(b":method", b"CONNECT"), (b":authority", b"example.com:443")]
WEBSOCKET: Headers = [
    (b":method", b"CONNECT"),
    (b":protocol", b"websocket"),
    (b":scheme", b"https"),
    (b":path", b"/chat"),
    (b":authority", A),
    (b"sec-websocket-version", b"13"),
]
OPTIONS: Headers = [
    (b":method", b"OPTIONS"),
    (b":scheme", b"https"),
    (b":path", b"*"),
    (b":authority", A),
]
HOST_ONLY: Headers = [
    (b":method", b"GET"),
    (b":scheme", b"http"),
    (b":path", b"/"),
    (b"host", A),
    (b"accept", b"text/event-stream"),
]
HOST_AND_AUTHORITY: Headers = [*GET[:4], (b"host", A), *GET[4:]]
SPLIT_COOKIES: Headers = [
    *CHAT[:5],
    (b"cookie", b"a=1"),
    (b"accept", b"*/*"),
    (b"cookie", b"b=2"),
    (b"cookie", b"c=3; d=4"),
]
NAMED = {
    "get": GET,
    "chat": CHAT,
    "grpc": GRPC,
    "connect": CONNECT,
    "websocket": WEBSOCKET,
    "options": OPTIONS,
    "host-only": HOST_ONLY,
    "host-and-authority": HOST_AND_AUTHORITY,
    "split-cookies": SPLIT_COOKIES,
}
BASES = list(NAMED.values())

# Fields that break a rule somewhere, or nearly: inserted anywhere in a valid block.
EXTRAS: Headers = [
    (b":status", b"200"),
    (b":foo", b"bar"),
    (b":", b"x"),
    (b"::path", b"/"),
    (b"a:b", b"c"),
    (b":protocol", b"websocket"),
    (b":method", b"GET"),
    (b":scheme", b"https"),
    (b":path", b"/"),
    (b":path", b""),
    (b":authority", A),
    (b":authority", b"other.example"),
    (b":authority", b""),
    (b"host", A),
    (b"host", b"other.example"),
    (b"host", b""),
    (b"host", b" example.com\t"),
    (b"te", b"trailers"),
    (b"te", b"Trailers"),
    (b"te", b" trailers "),
    (b"te", b"gzip"),
    (b"te", b"trailers, gzip"),
    (b"te", b""),
    (b"connection", b"keep-alive"),
    (b"keep-alive", b"timeout=5"),
    (b"proxy-connection", b"close"),
    (b"transfer-encoding", b"chunked"),
    (b"upgrade", b"h2c"),
    (b"http2-settings", b"AAMAAABkAAQAoAAAAAIAAAAA"),
    (b"Content-Type", b"text/plain"),
    (b"TE", b"trailers"),
    (b"Connection", b"close"),
    (b"Host", A),
    (b"", b"x"),
    (b"x-empty", b""),
    (b"x-ws", b"  a b \t"),
    (b"x-ws", b" \t "),
    (b"x-obs-fold", b"a\r\n b"),
    (b"x-lf", b"a\nb"),
    (b"x-cr", b"a\rb"),
    (b"x-nul", b"a\x00b"),
    (b"x-utf8", "café ✓".encode()),
    (b"x-high", b"\x80\xff"),
    (b"x-ctl", b"a\x01\x7fb"),
    (b"x-\xc3\xa9", b"v"),
    (b"cookie", b"z=9"),
    (b"cookie", b""),
]
METHODS = [b"GET", b"POST", b"CONNECT", b"OPTIONS", b"connect", b"", b" CONNECT "]
PATHS = [b"/", b"", b"*", b"x", b"//a", b" /", b"/ a", b"http://a/b"]


def mutations(base: Headers) -> Iterator[Headers]:
    """Each field of `base` dropped, doubled, moved, emptied, upper-cased, replaced; each
    extra field inserted at each place; the method and path swapped."""
    n = len(base)
    for i, (name, value) in enumerate(base):
        yield base[:i] + base[i + 1 :]
        yield base[: i + 1] + [(name, value)] + base[i + 1 :]
        yield [*base, (name, value)]
        yield [(name, value), *base[:i], *base[i + 1 :]]
        yield [*base[:i], *base[i + 1 :], (name, value)]
        for new in (
            (b"", value),
            (name, b""),
            (name.upper(), value),
            (name.capitalize(), value),
            (name, b" " + value),
            (name, value + b"\t"),
            (name, b"\t " + value + b" "),
            (name, value.lower()),
            (name, value.upper()),
        ):
            yield [*base[:i], new, *base[i + 1 :]]
        if name == b":method":
            for m in METHODS:
                yield [*base[:i], (name, m), *base[i + 1 :]]
        if name == b":path":
            for p in PATHS:
                yield [*base[:i], (name, p), *base[i + 1 :]]
    for j in range(n + 1):
        for extra in EXTRAS:
            yield [*base[:j], extra, *base[j:]]


def byte_sweeps(base: Headers) -> Iterator[Headers]:
    """Every byte at the start, middle and end of each name and each value."""
    for i, (name, value) in enumerate(base):
        for c in range(256):
            b = bytes([c])
            for new in (
                (b + name, value),
                (name[:2] + b + name[2:], value),
                (name + b, value),
                (name, b + value),
                (name, value[:2] + b + value[2:]),
                (name, value + b),
                (name, b),
            ):
                yield [*base[:i], new, *base[i + 1 :]]


def fuzz(seed: int, count: int) -> Iterator[Headers]:
    """Blocks built at random from the pieces above: a valid block's fields in shuffled or
    partial order, plus extras and mutated fields."""
    rnd = random.Random(seed)
    pieces = [h for base in BASES for h in base] + EXTRAS
    for _ in range(count):
        base = list(rnd.choice(BASES))
        shape = rnd.random()
        if shape < 0.3:
            rnd.shuffle(base)
        elif shape < 0.6:
            pseudo = [h for h in base if h[0][:1] == b":"]
            rnd.shuffle(pseudo)
            base = pseudo + [h for h in base if h[0][:1] != b":"]
        for _ in range(rnd.randint(0, 3)):
            base.insert(rnd.randint(0, len(base)), rnd.choice(pieces))
        for _ in range(rnd.randint(0, 2)):
            if base and rnd.random() < 0.5:
                del base[rnd.randrange(len(base))]
        if base and rnd.random() < 0.3:
            i = rnd.randrange(len(base))
            name, value = base[i]
            c = bytes([rnd.randrange(256)])
            base[i] = (name, value + c) if rnd.random() < 0.5 else (c + name, value)
        yield base


def test_valid_requests_pass_unchanged_but_stripped() -> None:
    for base in BASES:
        assert agree(base), base
    assert agree([(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"), (b"host", A)])
    stripped = request_headers([*GET, (b"authorization", b"Bearer t \t")])
    assert stripped == [*GET, (b"authorization", b"Bearer t")]


def test_hpack_tuples_come_out_as_tuples() -> None:
    raw: Headers = [HeaderTuple(n, v) for n, v in CHAT]
    raw[5] = NeverIndexedHeaderTuple(*CHAT[5])
    assert agree(raw)


def test_names_with_a_kind_of_their_own_decide_alike() -> None:
    """The names the single pass knows in advance, the common ones spared the check of their
    bytes among them, in each place of a valid block and with other values."""
    for name, kind in guard._NAMES.items():
        for value in (b"v", b"trailers", A, b""):
            for j in range(len(GET) + 1):
                agree([*GET[:j], (name, value), *GET[j:]])
        if kind == 0:
            assert agree([*CHAT, (name, b"v")]), name


@pytest.mark.parametrize("base", BASES, ids=list(NAMED))
def test_mutations_decide_alike(base: Headers) -> None:
    decided = [agree(m) for m in mutations(base)]
    assert any(decided) and not all(decided)


@pytest.mark.parametrize(
    "base", [GET, GRPC, WEBSOCKET, HOST_ONLY], ids=["get", "grpc", "ws", "host"]
)
def test_every_byte_in_names_and_values_decides_alike(base: Headers) -> None:
    decided = [agree(m) for m in byte_sweeps(base)]
    assert any(decided) and not all(decided)


def test_seeded_fuzz_decides_alike() -> None:
    decided = [agree(m) for m in fuzz(20240611, 6000)]
    # both answers are common, so neither side can pass by always saying one thing
    assert 0.1 < sum(decided) / len(decided) < 0.9


def test_corpus_reaches_every_rule_of_h2() -> None:
    """Each of h2's reasons to reject a request is met by the corpus (a rule the single pass
    dropped would show as a difference above)."""
    errors: set[str] = set()
    corpus = [m for base in BASES for m in mutations(base)]
    corpus += [m for base in (GET, GRPC) for m in byte_sweeps(base)]
    corpus += list(fuzz(7, 2000))
    for raw in corpus:
        agree(raw, errors)
    rules = [
        "Received uppercase header name",
        "in header name",
        "in header value",
        "Received header name with zero length",
        "Invalid value for TE header",
        "Connection-specific header field present",
        "Received duplicate pseudo-header field",
        "Received pseudo-header field out of sequence",
        "Received custom pseudo-header field",
        "missing mandatory b':method'",
        "missing mandatory b':scheme'",
        "missing mandatory b':path'",
        "Ordinary CONNECT MUST NOT include",
        "Encountered response-only headers",
        "Encountered connect-request-only headers",
        "has multiple Host headers",
        "does not have an :authority or Host header",
        "has mismatched :authority and Host headers",
        "An empty :path header is forbidden",
    ]
    assert [r for r in rules if not any(r in e for e in errors)] == []
