"""A hypothesis grammar of raw HTTP/1.x request streams for the differential engine test.

Mostly well-formed requests, each with a chance of one deviation taken from the smuggling and
parser-confusion catalogue: CL+TE, duplicate and signed Content-Length, Transfer-Encoding
variants, space before the colon, obs-fold, bare LF/CR, NUL/CTL bytes, odd whitespace, header
lines and counts around the policy limits, chunk sizes, extensions and trailers (well-formed or
not), bodies longer or shorter than their framing, HTTP/1.0 and odd versions, absolute and
asterisk targets, Expect and Connection values. A stream holds 1-3 pipelined requests.

Sizes are drawn around the limits of `tests.adapters.test_http.POLICY` (max_line_bytes 2048,
max_header_count 30, max_header_bytes 4096, max_body_bytes 1000).
"""

from __future__ import annotations

from hypothesis import strategies as st

LINE = 2048  # max_line_bytes of the test policy
COUNT = 30  # max_header_count
HEAD = 4096  # max_header_bytes
BODY = 1000  # max_body_bytes

METHODS = [b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"OPTIONS", b"PATCH", b"TRACE"]
ODD_METHODS = [b"CONNECT", b"get", b"Post", b"PRI", b"FOO", b"M-SEARCH", b"G\x00T", b"", b"GET\t"]

SAFE_SEG = st.sampled_from([b"x", b"v1", b"chat", b"completions", b"a.b", b"x%20y", b"~u", b"-"])
ODD_SEG = st.sampled_from(
    [b"..", b".", b"%2e%2e", b"%2F", b"a%2fb", b"%5c", b"\\", b"%00", b"a;b", b"", b"\xc3\xa9",
     b"\xff", b"a b", b"a#f", b"%zz", b"%", b"a\tb", b"@", b":"]
)  # fmt: skip
QUERY = st.sampled_from([b"", b"?a=1", b"?a=1&b=%20", b"?", b"??x", b"?a=\xc3\xa9", b"?x=/../"])
VERSIONS = [b"HTTP/2.0", b"HTTP/1.2", b"HTTP/0.9", b"http/1.1", b"HTTP/1.1 ", b"HTTP/11", b"HTTP/1"]
EOL_ODD = [b"\n", b"\r", b"\r\r\n", b"\n\r"]
NAME_CASES = st.sampled_from([bytes.lower, bytes.upper, bytes.title, lambda b: b])

OTHER_NAMES = [
    b"Accept", b"User-Agent", b"X-Custom", b"Authorization", b"Cookie", b"X-Forwarded-For",
    b"X-Forwarded-Proto", b"Keep-Alive", b"TE", b"Trailer", b"Upgrade", b"Proxy-Connection",
    b"X-Request-Id", b"Content-Type", b"Via", b"Forwarded", b"Max-Forwards", b"X-Dup",
]  # fmt: skip
ODD_NAMES = [
    b"X Y", b"X\tY", b"X\x00Y", b"X\x7fY", b"", b"X(Y)", b"\xc3\xa9", b"X@Y", b"Content-Length ",
    b" Transfer-Encoding", b"Transfer_Encoding", b"Content_Length", b"X/Y", b"{x}",
]  # fmt: skip
VALUE_CHARS = st.sampled_from(
    [b"a", b"Z", b"0", b" ", b"\t", b",", b";", b"=", b'"', b"/", b"\x80", b"\xff", b"\xc3\xa9"]
)
ODD_VALUE_CHARS = st.sampled_from([b"\x00", b"\x7f", b"\x01", b"\r", b"\n", b"\x0b", b"\x1f"])

CL_ODD = [
    b"+{n}", b"-{n}", b" {n}", b"{n} ", b"0{n}", b"{n},{n}", b"{n}, {n}", b"0x{n}", b"{n}.0",
    b"{n}a", b"", b"1{n}", b"99999999999999999999", b"18446744073709551616", b"\t{n}",
]  # fmt: skip
TE_ODD = [
    b"Chunked", b"CHUNKED", b"chunked ", b" chunked", b"\tchunked", b"chunked, chunked",
    b"gzip, chunked", b"chunked, gzip", b"identity", b"chunked;q=1", b"xchunked", b"chunked\x0b",
    b"", b"identity, chunked", b"chunk", b"\"chunked\"",
]  # fmt: skip
CONNECTION = [
    b"close", b"keep-alive", b"Close", b"CLOSE", b"keep-alive, close", b"close, X-Custom",
    b"X-Custom", b"Upgrade", b"TE", b"Keep-Alive, Accept", b"", b"cl ose", b"upgrade, close",
]  # fmt: skip
EXPECT = [b"100-continue", b"100-Continue", b"100-CONTINUE", b"magic", b"", b"100-continue, x"]


@st.composite
def value_text(draw: st.DrawFn, odd: bool) -> bytes:
    """A header value: mostly tokens and spaces; with `odd`, CTL bytes too."""
    chars = st.one_of(VALUE_CHARS, ODD_VALUE_CHARS) if odd else VALUE_CHARS
    return b"".join(draw(st.lists(chars, max_size=12)))


@st.composite
def target(draw: st.DrawFn, odd: bool) -> bytes:
    """/api/... (forwarded), another path (404); with `odd`, odd forms, segments and sizes."""
    kinds = ["api", "other", "absolute", "asterisk", "odd", "long"] if odd else ["api"] * 6
    kind = draw(st.sampled_from(kinds + ["other"]))
    seg = st.one_of(SAFE_SEG, ODD_SEG) if odd else SAFE_SEG
    segs = draw(st.lists(seg, min_size=1, max_size=4))
    path = b"/" + b"/".join(segs) + draw(QUERY)
    if kind == "api":
        return b"/api" + path
    if kind == "other":
        return path
    if kind == "absolute":
        return (
            draw(st.sampled_from([b"http://a", b"https://a:1", b"HTTP://x", b"//"]))
            + b"/api"
            + path
        )
    if kind == "asterisk":
        return b"*"
    if kind == "long":
        n = draw(st.sampled_from([LINE - 40, LINE - 20, LINE - 17, LINE - 16, LINE - 15,
                                  LINE - 14, LINE - 10, LINE, LINE + 10, 2 * LINE]))  # fmt: skip
        return b"/api/" + b"a" * n
    return draw(st.sampled_from([b"", b"api/x", b"/api/x y", b"/api/\x00", b"/api/\x7f", b"?x"]))


TRAILERS = [
    b"X-T: 1\r\n", b"Content-Length: 5\r\n", b"X-T 1\r\n", b"X-T: \x00\r\n",
    b"Transfer-Encoding: chunked\r\n", b"X-A: 1\r\nX-B: 2\r\n",
]  # fmt: skip
DEVIATIONS = [
    "method", "sp", "target", "version", "eol", "host", "cl", "te", "te_dup", "dup_cl", "both",
    "header", "sep", "trailing_ws", "fold", "junk", "chunk", "size",
]  # fmt: skip


def _pick(draw: st.DrawFn, normal: list[bytes], odd: list[bytes], on: bool) -> bytes:
    """The first normal choice, or (when this request's deviation is here) any odd one."""
    return draw(st.sampled_from(odd)) if on else draw(st.sampled_from(normal))


@st.composite
def chunked_body(draw: st.DrawFn, odd: bool) -> tuple[bytes, bool]:
    """(a chunked body, whether it has trailer fields); with `odd`, one of its parts malformed
    or unusual."""
    pieces = draw(st.lists(st.binary(min_size=1, max_size=40), max_size=4))
    if draw(st.integers(0, 7)) == 0:
        pieces = [b"b" * draw(st.sampled_from([BODY - 1, BODY, BODY + 1]))]
    where = draw(st.sampled_from(["eol", "size", "ext", "last", "trailer", "end"])) if odd else ""
    eol = _pick(draw, [b"\r\n"], [b"\n", b"\r", b"", b"\r\r\n"], where == "eol")
    out = b""
    for p in pieces:
        size = b"%x" % len(p)
        size = _pick(draw, [size], [
            size.upper(), b"0" + size, b" " + size, size + b" ", b"+" + size, b"0x" + size,
            b"%x" % (len(p) + 1), b"%x" % max(0, len(p) - 1), b"ffffffffffffffffff", b"-1",
        ], where == "size")  # fmt: skip
        ext = _pick(draw, [b""], [b";a=b", b";a", b"; a=b", b';a="b c"', b";\x00", b";a\nb",
                                  b" ;a"], where == "ext")  # fmt: skip
        out += size + ext + eol + p + eol
    last = _pick(draw, [b"0"], [b"00", b"0;x=y", b"000000", b"0 ", b"x"], where == "last")
    trailers = _pick(draw, [b""], TRAILERS, where == "trailer")
    end = _pick(draw, [b"\r\n"], [b"", b"\n", b"\r\n\r\n", b"\r"], where == "end")
    return out + last + eol + trailers + end, bool(trailers)


@st.composite
def filler_headers(draw: st.DrawFn, size: bool) -> list[tuple[bytes, bytes]]:
    """A few ordinary headers; with `size`, a count, a line or a total around the limits."""
    kind = draw(st.sampled_from(["count", "long", "total"])) if size else "few"
    if kind == "few":
        n = draw(st.integers(0, 3))
        return [(draw(st.sampled_from(OTHER_NAMES)), draw(value_text(odd=False))) for _ in range(n)]
    if kind == "count":  # around max_header_count (Host and framing come on top)
        n = draw(st.sampled_from([COUNT - 3, COUNT - 2, COUNT - 1, COUNT, COUNT + 1]))
        return [(b"X-H%d" % i, b"v") for i in range(n)]
    if kind == "long":  # one line around max_line_bytes (name + ": " + value)
        n = draw(st.sampled_from([LINE - 12, LINE - 10, LINE - 9, LINE - 8, LINE - 7, LINE - 6,
                                  LINE - 4, LINE, LINE + 1, 2 * LINE]))  # fmt: skip
        return [(b"X-Long", b"v" * (n - len(b"X-Long: ")))]
    # total around max_header_bytes: lines of 1000 bytes
    n = draw(st.sampled_from([HEAD - 200, HEAD - 60, HEAD - 40, HEAD - 20, HEAD, HEAD + 50]))
    out, left, i = [], n, 0
    while left > 0:
        size_ = min(left, 1000)
        out.append((b"X-T%d" % i, b"t" * max(1, size_ - 10)))
        left -= size_
        i += 1
    return out


@st.composite
def request(draw: st.DrawFn) -> tuple[bytes, bytes, list[int], bool]:
    """One request: (head and body, junk after it, offsets where a parser may see the message
    end: the head's end and the end its Content-Length declares, whether its body has
    trailers); a third of them with one deviation."""
    dev = draw(st.sampled_from(["none"] * (2 * len(DEVIATIONS)) + DEVIATIONS))
    method = _pick(draw, METHODS, ODD_METHODS, dev == "method")
    sp = _pick(draw, [b" "], [b"  ", b"\t", b" \t"], dev == "sp")
    sp2 = _pick(draw, [b" "], [b"  ", b"\t"], dev == "sp")
    tgt = draw(target(odd=dev == "target"))
    line = method + sp + tgt + sp2 + _pick(draw, [b"HTTP/1.1"] * 3 + [b"HTTP/1.0"], VERSIONS,
                                            dev == "version")  # fmt: skip
    eol = _pick(draw, [b"\r\n"], EOL_ODD, dev == "eol")
    headers: list[tuple[bytes, bytes]] = []
    host = draw(st.sampled_from([[], [b"a", b"b"], [b"a", b"a"], [b""], [b"a:1"], [b"a b"]]
                                if dev == "host" else [[b"a"]]))  # fmt: skip
    headers += [(b"Host", h) for h in host]
    headers += draw(filler_headers(size=dev == "size"))
    # Framing: none, Content-Length, chunked; the deviations: odd CL or TE, both, two CLs.
    framing = draw(st.sampled_from(["none", "cl", "cl", "te"]))
    if dev in ("cl", "dup_cl", "both"):
        framing = dev
    elif dev in ("te", "te_dup", "chunk"):
        framing = "te"
    data = draw(st.one_of(st.just(b""), st.binary(max_size=64), st.sampled_from(
        [b"x" * (BODY - 1), b"x" * BODY, b"x" * (BODY + 1)])))  # fmt: skip
    body, trailers = b"", False
    if framing in ("cl", "both", "dup_cl"):
        n = len(data)
        value = b"%d" % n
        if dev == "cl":
            how = draw(st.sampled_from(["short", "long", "odd", "odd"]))
            if how == "short":
                value = b"%d" % max(0, n - 1)
            elif how == "long":
                value = b"%d" % (n + 1)
            else:
                value = draw(st.sampled_from(CL_ODD)).replace(b"{n}", b"%d" % n)
        headers.append((b"Content-Length", value))
        if framing == "dup_cl":
            headers.append((b"Content-Length", draw(st.sampled_from([value, b"%d" % (n + 1)]))))
        body = data
    if framing in ("te", "both"):
        headers.append((b"Transfer-Encoding", _pick(draw, [b"chunked"], TE_ODD, dev == "te")))
        if dev == "te_dup":
            headers.append((b"Transfer-Encoding", draw(st.sampled_from([b"chunked"] + TE_ODD))))
        body, trailers = draw(chunked_body(odd=dev == "chunk"))
    if draw(st.integers(0, 4)) == 0:
        headers.append((b"Connection", draw(st.sampled_from(CONNECTION))))
    if draw(st.integers(0, 6)) == 0:
        headers.append((b"Expect", draw(st.sampled_from(EXPECT))))
    if dev == "header":
        headers.append((draw(st.sampled_from(ODD_NAMES + OTHER_NAMES)), draw(value_text(odd=True))))
    headers = draw(st.permutations(headers))
    case = draw(NAME_CASES)
    sep = st.sampled_from([b":", b":\t", b":  ", b" : ", b" :", b"\t:"] if dev == "sep"
                          else [b": ", b":"])  # fmt: skip
    ws = st.sampled_from([b" ", b"\t", b" \t"] if dev == "trailing_ws" else [b""])
    lines = [case(n) + draw(sep) + v + draw(ws) for n, v in headers]
    if dev == "fold" and lines:
        lines[-1] += b"\r\n" + draw(st.sampled_from([b" ", b"\t"])) + draw(value_text(odd=False))
    head = line + eol + b"".join(h + eol for h in lines) + eol
    junk = _pick(draw, [b""], [b"\r\n", b"\n", b"x", b"\r\n\r\n", b"\x00"], dev == "junk")
    marks = [len(head)]
    declared = [v for n, v in headers if n == b"Content-Length" and v.isdigit()]
    if declared and framing != "te":
        marks.append(len(head) + int(declared[0]))
    return head + body, junk, marks, trailers


@st.composite
def stream(draw: st.DrawFn) -> tuple[bytes, list[int], list[int], bool]:
    """(bytes of 1-3 pipelined requests, where the client splits its writes, where each
    generated request, its head and the junk after it end, whether a body has trailers)."""
    reqs = draw(st.lists(request(), min_size=1, max_size=3))
    data, ends = b"", []
    for msg, junk, marks, _ in reqs:
        ends += [len(data) + m for m in marks]
        data += msg
        ends.append(len(data))
        data += junk
        ends.append(len(data))
    cuts = draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=2, unique=True))
    ends = sorted({e for e in ends if 0 < e < len(data)})
    trailers = any(r[3] for r in reqs)
    return data, sorted(c for c in cuts if c < len(data)), ends, trailers
