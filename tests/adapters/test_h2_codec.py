"""The HTTP/2 engine's codec settings (`gateway.adapters.h2.codec`): h2's options read as plain
attributes keep the values given, header blocks sent without Huffman coding decode to the
same fields with a stock decoder (and a stock h2 client), the decoder that keeps the lists of
blocks seen again answers (and fails) as hpack's own does, and the compiled Huffman decoder
(`gateway.adapters.h2.huffman`) answers and fails as hpack's own does."""

from __future__ import annotations

import random

import hpack.hpack
import pytest
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import ResponseReceived
from hpack import Decoder, Encoder, HPACKDecodingError, NeverIndexedHeaderTuple
from hpack import huffman_table as stock_huffman
from hpack.exceptions import InvalidTableSizeError, OversizedHeaderListError
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH

from gateway.adapters.h2 import huffman
from gateway.adapters.h2.codec import (
    FIELD_COST,
    KEPT_BLOCKS,
    KEPT_BYTES,
    Config,
    ListDecoder,
    PlainEncoder,
)
from gateway.adapters.h2.guard import server_h2, start_h2
from gateway.policy.base import Http2Limits


def test_config_options_are_the_ones_given() -> None:
    c = Config(client_side=False, header_encoding=None, validate_inbound_headers=False)
    assert (c.client_side, c.header_encoding, c.validate_inbound_headers) == (False, None, False)
    assert c.validate_outbound_headers and c.normalize_outbound_headers  # h2's defaults
    assert "client_side" in vars(c)  # a plain attribute, not the descriptor's `_client_side`
    c = Config(client_side=True, validate_outbound_headers=False)
    assert c.client_side and not c.validate_outbound_headers


def test_plain_encoder_strings_decode_the_same_without_huffman() -> None:
    fields = [
        (b":status", b"200"),
        (b"content-type", b"application/json"),
        NeverIndexedHeaderTuple(b"x-request-id", b"89539801db42846880547e940d24ab35"),
    ]
    plain, stock = PlainEncoder(), Encoder()
    block = plain.encode(fields)
    assert Decoder().decode(block, raw=True) == [(n, v) for n, v in fields]
    assert b"89539801db42846880547e940d24ab35" in block  # not Huffman-coded
    assert b"89539801db42846880547e940d24ab35" not in stock.encode(fields)
    assert len(plain.encode(fields)) < len(block)  # the repeated fields are indexed now


def test_an_answer_through_the_engine_state_reaches_a_stock_client() -> None:
    limits = Http2Limits()
    srv = server_h2(limits)
    assert isinstance(srv.encoder, PlainEncoder) and isinstance(srv.config, Config)
    assert isinstance(srv.decoder, ListDecoder)
    assert srv.decoder.max_header_list_size == limits.max_header_list_bytes
    start_h2(srv, limits)
    cli = H2Connection(H2Configuration(client_side=True, header_encoding=None))
    cli.initiate_connection()
    srv.receive_data(cli.data_to_send())
    cli.receive_data(srv.data_to_send())
    cli.send_headers(1, [(b":method", b"GET"), (b":path", b"/"), (b":scheme", b"http"),
                         (b":authority", b"x")], end_stream=True)  # fmt: skip
    srv.receive_data(cli.data_to_send())
    headers = [(b":status", b"200"), (b"server", b"sluice"), (b"date", b"Sat, 05 Dec 2026")]
    srv.send_headers(1, headers, end_stream=True)
    events = cli.receive_data(srv.data_to_send())
    got = [e for e in events if isinstance(e, ResponseReceived)]
    assert got and list(got[0].headers or []) == headers


REQUEST = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":authority", b"127.0.0.1:8443"),
    (b":path", b"/sluice.inference.v1.Inference/Infer"),
    (b"content-type", b"application/grpc"),
    (b"te", b"trailers"),
]


def _decoded(decoder: Decoder, block: bytes) -> list[tuple[bytes, bytes]] | str:
    """What `decoder` makes of `block` (h2 asks for raw bytes), or its error's class."""
    try:
        return [tuple(f) for f in decoder.decode(block, raw=True)]  # type: ignore[misc]
    except HPACKDecodingError as e:
        return type(e).__name__


def test_a_block_seen_again_is_answered_from_its_list() -> None:
    enc, ours = Encoder(), ListDecoder(65536)
    first = enc.encode(REQUEST)  # literals with indexing: the table changes, nothing kept
    assert ours.decode(first, raw=True) == REQUEST and not ours.kept
    again = enc.encode(REQUEST)  # all indexed now
    assert len(again) == len(REQUEST)
    got = ours.decode(again, raw=True)
    assert got == REQUEST and list(ours.kept) == [again]
    got.append((b"x-mine", b"1"))  # a caller's list is its own
    assert ours.decode(again, raw=True) == REQUEST


def test_a_block_seen_again_after_the_table_changed_reads_the_new_table() -> None:
    enc, ours, stock = Encoder(), ListDecoder(65536), Decoder()
    for block in (enc.encode([(b"x-a", b"1")]), enc.encode([(b"x-a", b"1")])):
        assert _decoded(ours, block) == _decoded(stock, block)
    indexed = enc.encode([(b"x-a", b"1")])  # one byte: the dynamic table's first entry
    assert _decoded(ours, indexed) == [(b"x-a", b"1")] and ours.kept
    moved = enc.encode([(b"x-b", b"2")])  # now the first entry; x-a second
    assert _decoded(ours, moved) == _decoded(stock, moved) and not ours.kept
    assert _decoded(ours, indexed) == _decoded(stock, indexed) == [(b"x-b", b"2")]


def test_a_table_size_update_forgets_the_kept_lists() -> None:
    enc, ours, stock = Encoder(), ListDecoder(65536), Decoder()
    for block in (enc.encode([(b"x-a", b"1")]), b"\xbe"):  # x-a, then the table's first entry
        assert _decoded(ours, block) == _decoded(stock, block) == [(b"x-a", b"1")]
    assert list(ours.kept) == [b"\xbe"]
    emptied = b"\x20\x82"  # a size update to 0 (the table empties), then `:method: GET`
    assert _decoded(ours, emptied) == _decoded(stock, emptied) == [(b":method", b"GET")]
    assert not ours.kept
    assert _decoded(ours, b"\xbe") == _decoded(stock, b"\xbe") == "InvalidTableIndex"


def test_the_kept_lists_stay_bounded() -> None:
    ours = ListDecoder(1 << 20)
    enc = Encoder()
    for i in range(5 * KEPT_BLOCKS):  # literals never indexed: the table never changes
        block = enc.encode([NeverIndexedHeaderTuple(b"x-n", str(i).encode())])
        assert _decoded(ours, block) == [(b"x-n", str(i).encode())]
        assert len(ours.kept) <= KEPT_BLOCKS
    assert len(ours.kept) == KEPT_BLOCKS
    newest = NeverIndexedHeaderTuple(b"x-n", str(5 * KEPT_BLOCKS - 1).encode())
    assert newest in [f for fields, _ in ours.kept.values() for f in fields]  # the oldest gone
    assert ours.kept_cost == sum(cost for _, cost in ours.kept.values()) <= KEPT_BYTES
    # A block of one-byte indexed fields decodes to a field object a byte: counted by its
    # fields, it is too dear to keep, and one just within the budget pushes the others out.
    many = b"\x82" * 200  # `:method: GET`, 200 times
    assert len(_decoded(ours, many)) == 200
    assert many not in ours.kept and len(ours.kept) == KEPT_BLOCKS
    fit = (KEPT_BYTES - FIELD_COST) // (FIELD_COST + 1)
    assert _decoded(ours, b"\x82" * fit) == [(b":method", b"GET")] * fit
    assert list(ours.kept) == [b"\x82" * fit] and ours.kept_cost <= KEPT_BYTES
    long = enc.encode([NeverIndexedHeaderTuple(b"x-long", b"v" * KEPT_BYTES)], huffman=False)
    assert _decoded(ours, long) == [(b"x-long", b"v" * KEPT_BYTES)]
    assert long not in ours.kept
    for i in range(50):  # and a busy connection's many blocks stay within both bounds
        block = enc.encode([NeverIndexedHeaderTuple(b"x-v", b"w" * (i * 40))], huffman=False)
        _decoded(ours, block)
        assert len(ours.kept) <= KEPT_BLOCKS and ours.kept_cost <= KEPT_BYTES


def test_a_kept_block_still_meets_the_limits_set_since() -> None:
    enc = Encoder()
    enc.encode(REQUEST)
    again = enc.encode(REQUEST)
    ours = ListDecoder(65536)
    ours.decode(Encoder().encode(REQUEST), raw=True)  # the same table as `enc`'s
    assert _decoded(ours, again) == REQUEST and ours.kept
    ours.max_header_list_size = 64  # as h2 sets it at a SETTINGS ack
    with pytest.raises(OversizedHeaderListError):
        ours.decode(again, raw=True)
    ours.max_header_list_size = 65536
    assert _decoded(ours, again) == REQUEST and ours.kept
    ours.max_allowed_table_size = 100  # our SETTINGS shrank the table; the peer did not
    with pytest.raises(InvalidTableSizeError):
        ours.decode(again, raw=True)


def test_the_list_decoder_answers_as_hpacks_own_at_random() -> None:
    rng = random.Random(7)
    names = [b"x-a", b"x-b", b"authorization", b"content-type", b"user-agent"]
    values = [b"1", b"2", b"Bearer " + b"t" * 200, b"application/grpc", b"v" * 3000]

    def fields() -> list[tuple[bytes, bytes]]:
        out = []
        for _ in range(rng.randint(1, 6)):
            field = (rng.choice(names), rng.choice(values))
            out.append(NeverIndexedHeaderTuple(*field) if rng.random() < 0.3 else field)
        return out

    requests = [fields() for _ in range(6)]  # what clients repeat; now and then a new one
    enc, ours, stock = Encoder(), ListDecoder(16384), Decoder(16384)
    hits = 0
    for _ in range(3000):
        if rng.random() < 0.01:
            enc.header_table_size = rng.choice((0, 256, 4096))
        sent = fields() if rng.random() < 0.1 else rng.choice(requests)
        block = enc.encode(sent, huffman=rng.random() < 0.8)
        hits += block in ours.kept
        assert _decoded(ours, block) == _decoded(stock, block)
        if rng.random() < 0.01:  # a block from elsewhere: both fail, or both read the same
            junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 12)))
            mine, theirs = _decoded(ours, junk), _decoded(stock, junk)
            assert mine == theirs
            if isinstance(mine, str):  # the tables may differ after an error: start again
                enc, ours, stock = Encoder(), ListDecoder(16384), Decoder(16384)
    assert hits > 100  # blocks did repeat, and were answered from their lists


def _stock(data: bytes) -> bytes | str:
    """hpack's own decoding of `data`, or its error's message."""
    try:
        return stock_huffman.decode_huffman(data)
    except HPACKDecodingError as e:
        return str(e)


def _ours(data: bytes | bytearray | memoryview) -> bytes | str:
    try:
        return huffman.decode_huffman(data)
    except HPACKDecodingError as e:
        return str(e)


def test_huffman_decoding_answers_as_hpacks_own_for_every_octet_and_at_random() -> None:
    """Every octet value coded alone and in a string, random coded strings, and random bytes
    (mostly invalid: a code that does not exist, EOS, padding that is not EOS's prefix): the
    same octets or the same error."""
    import random

    rng = random.Random(7)
    coder = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)
    every = bytes(range(256))
    cases = [b"", coder.encode(every), *(coder.encode(bytes([b])) for b in every)]
    for _ in range(300):
        plain = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
        cases.append(coder.encode(plain))
        cases.append(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))))
    outcomes = {"ok": 0, "error": 0}
    for data in cases:
        want = _stock(data)
        assert _ours(data) == want, data
        assert _ours(bytearray(data)) == want and _ours(memoryview(data)) == want
        outcomes["ok" if isinstance(want, bytes) else "error"] += 1
    assert outcomes["ok"] > 500 and outcomes["error"] > 100  # both paths were compared
    assert coder.encode(every) and huffman.decode_huffman(coder.encode(every)) == every
    assert huffman.decode_huffman(None) == b""
    with pytest.raises(HPACKDecodingError, match="Incomplete"):
        huffman.decode_huffman(coder.encode(b"token")[:-1] + b"\x00")


def test_hpack_and_h2_log_nothing_whatever_the_level(caplog: pytest.LogCaptureFixture) -> None:
    """hpack's modules and the engine's h2 state log through `QUIET`: a decoded never-indexed
    token is not logged at DEBUG (the gateway-level test is in tests/integration/test_h2.py)."""
    import hpack.table

    from gateway.adapters.h2.codec import QUIET

    assert hpack.hpack.log is QUIET and hpack.table.log is QUIET  # type: ignore[attr-defined]
    limits = Http2Limits()
    srv = server_h2(limits)
    assert srv.config.logger is QUIET
    assert QUIET.debug("%s %d", b"x", 1) == "" and QUIET.trace("%s", b"x", k=1) == ""
    enc, dec = Encoder(), Decoder()
    caplog.set_level("DEBUG")
    block = enc.encode([NeverIndexedHeaderTuple(b"authorization", b"Bearer not-in-the-log")])
    assert dec.decode(block, raw=True) == [(b"authorization", b"Bearer not-in-the-log")]
    assert "not-in-the-log" not in caplog.text


def test_a_long_string_is_decoded_once_and_the_kept_decodings_stay_bounded() -> None:
    """A token's coded bytes seen again are answered from the kept decoding (the same object);
    short and over-long strings and invalid ones are not kept; past `CACHE_ENTRIES` the oldest
    goes first, so the kept strings never exceed the bound."""
    coder = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)
    kept = huffman.DECODED
    kept.clear()
    token = b"Bearer eyJhbGciOiJIUzI1NiJ9." + b"x9_-Qz" * 40
    coded = coder.encode(token)
    assert huffman.CACHE_MIN <= len(coded) <= huffman.CACHE_MAX
    first = huffman.decode_huffman(coded)
    assert first == token == _stock(coded)
    assert kept[coded] is first and huffman.decode_huffman(bytes(coded)) is first
    assert huffman.decode_huffman(memoryview(coded)) is first
    short, long = coder.encode(b"gzip, deflate"), coder.encode(b"a" * 2000)
    assert len(short) < huffman.CACHE_MIN and len(long) > huffman.CACHE_MAX
    assert huffman.decode_huffman(short) == b"gzip, deflate"
    assert huffman.decode_huffman(long) == b"a" * 2000
    bad = coded + b"\xff\xff\xff\xff"  # EOS inside the string
    with pytest.raises(HPACKDecodingError):
        huffman.decode_huffman(bad)
    assert set(kept) == {coded}  # neither the short, the over-long nor the invalid one
    many = [coder.encode(b"Bearer %06d" % i + b"-" * 90) for i in range(huffman.CACHE_ENTRIES + 5)]
    for c in many:
        huffman.decode_huffman(c)
    assert len(kept) == huffman.CACHE_ENTRIES
    assert coded not in kept and many[4] not in kept and many[5] in kept and many[-1] in kept
    assert kept[many[-1]] == b"Bearer %06d" % (huffman.CACHE_ENTRIES + 4) + b"-" * 90
    kept.clear()


def test_hpacks_decoder_decodes_a_never_indexed_token_with_the_compiled_decoder() -> None:
    """The engine's h2 state decodes header blocks with `huffman.decode_huffman` (the codec set
    it in hpack), and a stock client's Huffman-coded, never-indexed bearer token arrives whole."""
    assert hpack.hpack.decode_huffman is huffman.decode_huffman  # type: ignore[attr-defined]
    limits = Http2Limits()
    srv = server_h2(limits)
    start_h2(srv, limits)
    cli = H2Connection(H2Configuration(client_side=True, header_encoding=None))
    cli.initiate_connection()
    srv.receive_data(cli.data_to_send())
    token = b"Bearer eyJhbGciOiJIUzI1NiJ9." + b"x9_-Qz" * 40
    request = [(b":method", b"GET"), (b":path", b"/"), (b":scheme", b"http"),
               (b":authority", b"x"), (b"authorization", token)]  # fmt: skip
    cli.send_headers(1, request, end_stream=True)
    block = cli.data_to_send()
    assert token not in block  # sent Huffman-coded (and never indexed: h2's choice for it)
    events = srv.receive_data(block)
    got = [dict(e.headers or []) for e in events if hasattr(e, "headers")]
    assert got and got[0][b"authorization"] == token
