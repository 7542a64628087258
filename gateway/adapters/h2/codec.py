"""What the HTTP/2 engine changes of python-hyper `h2`'s codec for speed, with the same frames'
meaning: its configuration read as plain attributes, and header strings encoded without Huffman.

- `Config`: h2 reads its options (`client_side`, `validate_outbound_headers`, …) from its
  configuration on every frame and header block, each read a call of h2's checking descriptor
  (about 5 % of an h2c request's CPU). Here the same options are plain attributes; the values
  are set once, by `H2Configuration.__init__`, and never changed.
- `PlainEncoder`: hpack's encoder Huffman-codes every literal string it emits, in Python, byte by
  byte. Once the dynamic table holds the response fields that repeat, the literals left are the
  values new in each answer (`x-request-id`, `content-length`, a new `date` each second):
  sent as plain octets (RFC 7541 §5.2 leaves the choice to the encoder), they cost a few bytes
  more each (about 10 per answer) and no Huffman pass (≈ 20 µs per answer here).
- Huffman decoding: hpack's decoder calls its module's `decode_huffman`, which walks its table in
  Python (≈ 25 µs for a 250-byte bearer token, decoded again on every request: clients send
  `authorization` never indexed). That name is set here to `gateway.adapters.h2.huffman`'s:
  the same table and answers, compiled (≈ 3 µs). It is hpack's module-wide name, so every
  hpack decoder in the process uses it.
- `ListDecoder`: hpack's decoder spends ~2 µs a field in Python (~15 µs for a gRPC call's
  eight indexed fields, every call), though a client that repeats a request sends the same
  header block again, byte for byte, once its fields are in the dynamic table (indexed fields,
  and literals that are not indexed, as a bearer token). A block's meaning depends only on its
  bytes and the dynamic table, so the decoder keeps the lists of the last few blocks that did
  not change the table (a few KiB at most), and forgets them all whenever the table changes (a
  literal with indexing, a size update) or the header-list limit does: a block seen again
  meanwhile is answered from its list (~0.3 µs).
- hpack's logging: its decoder logs every field it decodes at DEBUG, the value in clear (a
  client's bearer token: `--log-level DEBUG` would write it to the log), and its encoder and
  decoder make ~30 `log.debug` calls a request even when DEBUG is off (two Python calls and a
  level check each, ≈ 3 µs a request). hpack's module-wide `log` names are set here to `QUIET`,
  which says nothing: no level shows a header's value. h2's connections get it too (`server_h2`),
  in place of h2's own silent logger, a Python call each time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import hpack.hpack
import hpack.table
from h2.config import H2Configuration
from hpack import Decoder, Encoder

from gateway.adapters.h2.huffman import decode_huffman

__all__ = ["QUIET", "UNIQUE", "Config", "ListDecoder", "PlainEncoder"]


class _Quiet:
    """A logger that writes nothing, for hpack's modules and h2's connections (they call only
    `debug` and `trace`). Both are the empty string's `format`: a call into C that takes any
    arguments and returns "" (≈ 50 ns; a Python function that does nothing costs twice that, and
    hpack and h2 call these ~40 times a request)."""

    __slots__ = ()
    debug = trace = "".format

    def __getattr__(self, name: str) -> Any:
        return "".format  # any other logger method a later hpack or h2 may call: nothing


QUIET: Any = _Quiet()

hpack.hpack.decode_huffman = decode_huffman  # type: ignore[attr-defined]  # (imported there)
hpack.hpack.log = hpack.table.log = QUIET


class Config(H2Configuration):
    """`H2Configuration` whose boolean options are plain instance attributes (class attributes
    that are not descriptors shadow the base class's: `__init__` sets them on the instance)."""

    client_side = False
    validate_outbound_headers = False
    normalize_outbound_headers = False
    split_outbound_cookies = False
    validate_inbound_headers = False
    normalize_inbound_headers = False


# Response fields whose value is new in (nearly) every answer: the request id, Sluice's overhead
# figure, and a body's length (an LLM's answers differ in length), with the fields of one
# resource's answer (etag, age, location, set-cookie: a cookie is a secret too). Sent as
# literals never indexed. In the dynamic table they would only push out the values that repeat,
# and hpack's encoder searches that table linearly for every field it sends: with its 4 KiB full
# of them (~70 entries), ~6 µs more per gRPC answer (its HEADERS and trailers), and an HTTP/2
# answer's encoding ~1.8 times as dear with a content-length new in each.
UNIQUE: Final = frozenset(
    (
        b"x-request-id",
        b"x-sluice-overhead-ms",
        b"content-length",
        b"etag",
        b"age",
        b"location",
        b"set-cookie",
    )
)


class PlainEncoder(Encoder):
    """hpack's `Encoder`, its literal strings never Huffman-coded."""

    def encode(self, headers: Iterable[Any], huffman: bool = False) -> bytes:
        return super().encode(headers, huffman=False)


# What a connection's `ListDecoder` keeps: the lists of at most this many blocks, costing at most
# this many bytes in all, a block counted as its coded bytes and FIELD_COST a field of its list.
# (The header-list limit lets a 2 KiB block of one-byte indexed fields decode to hundreds of
# field objects: the count of fields, not the block's bytes, is what weighs.) Its literal values
# are at most 8/5 of the coded bytes (Huffman), so a connection's kept lists hold ~10 KiB at
# worst, beside the ~15 KiB of its h2 state.
KEPT_BLOCKS: Final = 8
KEPT_BYTES: Final = 4096
FIELD_COST: Final = 64


class ListDecoder(Decoder):
    """hpack's `Decoder`, answering a header block seen again, while the dynamic table has not
    changed since, from the list it decoded to (see above)."""

    def __init__(self, max_header_list_size: int) -> None:
        super().__init__(max_header_list_size)
        self.kept: dict[bytes, tuple[tuple[Any, ...], int]] = {}  # block → (its fields, cost)
        self.kept_cost = 0
        self.kept_limit = max_header_list_size  # the header-list limit the lists were read under
        self.changed = False  # the block being decoded changed the dynamic table

    def decode(self, data: bytes, raw: bool = False) -> Any:
        kept = self.kept
        if self.max_header_list_size != self.kept_limit:  # h2 sets it at a SETTINGS ack
            self.kept_limit = self.max_header_list_size
            self.forget()
        if raw and type(data) is bytes:
            hit = kept.get(data)
            if hit is not None:
                self._assert_valid_table_size()  # its maximum moves at a SETTINGS ack
                return list(hit[0])
        self.changed = False
        headers = super().decode(data, raw)
        if raw and not self.changed and type(data) is bytes:
            fields = tuple(headers)
            cost = len(data) + FIELD_COST * len(fields)
            if cost <= KEPT_BYTES:
                while kept and (len(kept) >= KEPT_BLOCKS or self.kept_cost + cost > KEPT_BYTES):
                    self.kept_cost -= kept.pop(next(iter(kept)))[1]  # the oldest
                kept[data] = (fields, cost)
                self.kept_cost += cost
        return headers

    def forget(self) -> None:
        self.kept.clear()
        self.kept_cost = 0

    def _decode_literal_index(self, data: bytes | memoryview) -> Any:
        self.changed = True
        self.forget()
        return super()._decode_literal_index(data)

    def _update_encoding_context(self, data: bytes | memoryview) -> int:
        self.changed = True
        self.forget()
        return super()._update_encoding_context(data)
