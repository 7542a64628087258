"""The native HTTP/1.1 engine (`listeners.http.engine: native`, the default): an
`asyncio.Protocol` with the httptools (llhttp) parser. `server` is the listener, `conn` a
connection (its head parser, queue, timers and flow control), `exchange` one request as an
`Exchange`, `messages` the parsed request and canned answers. A connection that opens with the
HTTP/2 preface, or negotiates `h2` by ALPN, goes to the `gateway.adapters.h2` engine.
"""

from __future__ import annotations

from gateway.adapters.native.server import NativeListener, start_native

__all__ = ["NativeListener", "start_native"]
