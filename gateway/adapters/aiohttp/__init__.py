"""The aiohttp HTTP/1.1 engine (`listeners.http.engine: aiohttp`): aiohttp's low-level server
with the native engine's refusals and header-read deadline added. `server` is the listener,
`exchange` one request as an `Exchange`.
"""

from __future__ import annotations

from gateway.adapters.aiohttp.server import HttpListener, start_aiohttp

__all__ = ["HttpListener", "start_aiohttp"]
