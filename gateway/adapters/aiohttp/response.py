"""The aiohttp engine's responses: `SluiceResponse`, a `web.StreamResponse` whose head is
Sluice's own header lines, and `SENT`, what aiohttp is handed for an answer the exchange wrote
itself (`gateway.adapters.aiohttp.exchange`). Interpreted: they subclass aiohttp's classes.
"""

from __future__ import annotations

from typing import Any

from aiohttp import hdrs, web

from gateway.adapters.common import REASONS

_OWN = ((hdrs.CONTENT_LENGTH, b"content-length"), (hdrs.TRANSFER_ENCODING, b"transfer-encoding"))


class SluiceResponse(web.StreamResponse):
    """A StreamResponse whose head is Sluice's header lines plus aiohttp's framing; it leaves
    with the first body bytes (one write, not two)."""

    _send_headers_immediately = False

    def __init__(self, status: int, lines: bytes, date: bool) -> None:
        super().__init__(status=status)
        self.sluice_lines = lines
        self.sluice_date = date

    async def _write_headers(self) -> None:
        writer: Any = self._payload_writer
        h = self._headers
        out = bytearray(b"HTTP/1.1 %d %b\r\n" % (self.status, REASONS.get(self.status, b"")))
        out += self.sluice_lines
        for key, name in _OWN:
            v = h.get(key)
            if v is not None:
                out += b"%b: %b\r\n" % (name, v.encode("ascii"))
        conn = h.get(hdrs.CONNECTION)
        if conn is not None:
            out += b"connection: %b\r\n" % conn.encode("ascii")
        if not self.sluice_date:
            out += b"date: %b\r\n" % h[hdrs.DATE].encode("ascii")
        out += b"\r\n"
        # What StreamWriter.write_headers does with its serialised head (aiohttp 3.x).
        writer._headers_buf = bytes(out)
        writer._headers_written = False


class _Sent(web.StreamResponse):
    """What aiohttp's server is handed back for an answer the exchange wrote itself
    (`AiohttpExchange.respond`): its EOF is sent (`prepare` and `write_eof` return at once) and
    the connection is kept. One instance serves all, never changed: aiohttp reads only
    `keep_alive` off it."""

    def __init__(self) -> None:
        super().__init__()
        self._eof_sent = True
        self._keep_alive = True


SENT = _Sent()
