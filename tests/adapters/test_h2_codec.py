"""The HTTP/2 engine's codec settings (`gateway.adapters.h2.codec`): h2's options read as plain
attributes keep the values given, and header blocks sent without Huffman coding decode to the
same fields with a stock decoder (and a stock h2 client)."""

from __future__ import annotations

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import ResponseReceived
from hpack import Decoder, Encoder, NeverIndexedHeaderTuple

from gateway.adapters.h2.codec import Config, PlainEncoder
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
