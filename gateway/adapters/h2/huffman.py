"""(compiled) HPACK's Huffman decoding (RFC 7541 §5.2, Appendix B).

hpack decodes a Huffman-coded string in Python, a table lookup per 4-bit nibble: ≈ 25 µs for a
bearer token of 250 bytes. Clients send `authorization` never indexed (RFC 7541 §7.1.3; h2 and
nghttp2 do), so the token is decoded again on every request of an HTTP/2 or gRPC connection.
This is the same state machine over the same table (hpack's, flattened once into bytes), with
the same answers and the same errors, compiled: ≈ 3 µs. `gateway.adapters.h2.codec` puts it in
hpack's decoder.

A client sends the same token, coded the same way, with each of its requests, over each of its
connections: a long string's decoding is kept (`CACHE_ENTRIES` strings of `CACHE_MIN` to
`CACHE_MAX` coded octets, the oldest dropped first; under 3 MB), and the same coded bytes are
answered from it (≈ 0.1 µs, a hash and a compare, not ≈ 4.5 µs). Only exact, complete, valid
coded strings are kept: an invalid one raises before it could be, and the key is the whole string,
so a lookup tells nothing about any part of a string that was not sent whole. The process holds
these tokens already (the JWT cache); this adds no copy that outlives its bound.
"""

from __future__ import annotations

from typing import Final

from hpack import huffman_table
from hpack.exceptions import HPACKDecodingError

__all__ = ["decode_huffman"]


def _flatten(table: list[tuple[int, int, int]]) -> bytes:
    """hpack's table (256 nodes × 16 nibbles of (next state, flags, symbol)) as one bytes."""
    out = bytearray()
    for state, flags, symbol in table:
        out += bytes((state, flags, symbol))
    return bytes(out)


_FSM: Final = _flatten(huffman_table.HUFFMAN_TABLE)
_COMPLETE: Final = huffman_table.HUFFMAN_COMPLETE
_EMIT: Final = huffman_table.HUFFMAN_EMIT_SYMBOL
_FAIL: Final = huffman_table.HUFFMAN_FAIL

CACHE_MIN: Final = 64  # coded octets: a bearer token, a long query, not a short field
CACHE_MAX: Final = 1024
CACHE_ENTRIES: Final = 1024
DECODED: dict[bytes, bytes] = {}  # coded → decoded, oldest first (read by the tests)


def decode_huffman(huffman_string: bytes | bytearray | memoryview | None) -> bytes:
    """The decoded octets of a Huffman-coded HPACK string; HPACKDecodingError if it is not one
    (a code that does not exist, EOS, or padding that is not a prefix of EOS)."""
    if not huffman_string:
        return b""
    data = bytes(huffman_string)
    n = len(data)
    kept = CACHE_MIN <= n <= CACHE_MAX
    if kept:
        hit = DECODED.get(data)
        if hit is not None:
            return hit
    fsm = _FSM
    out: list[int] = []
    state = 0
    flags = 0
    for k in range(2 * n):  # two 4-bit nibbles an octet, the high one first
        byte = data[k >> 1]
        i = (state * 16 + (byte & 15 if k & 1 else byte >> 4)) * 3
        state = fsm[i]
        flags = fsm[i + 1]
        if flags & _FAIL:
            raise HPACKDecodingError("Invalid Huffman string")
        if flags & _EMIT:
            out.append(fsm[i + 2])
    if not flags & _COMPLETE:
        raise HPACKDecodingError("Incomplete Huffman string")
    decoded = bytes(out)
    if kept:
        if len(DECODED) >= CACHE_ENTRIES:
            del DECODED[next(iter(DECODED))]  # the oldest
        DECODED[data] = decoded
    return decoded
