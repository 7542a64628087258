"""Opening one upstream connection: TCP, then TLS when the backend has it, by a deadline.

Kept out of the compiled request path (`gateway.native`): it runs once per new connection, not
per request.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable

from gateway.errors import UpstreamConnectError, UpstreamTimeout
from gateway.tls.upstream import ClientTls, handshake_failed
from gateway.upstream.conn import UpstreamConn


async def dial(
    loop: asyncio.AbstractEventLoop,
    new: Callable[[], UpstreamConn],
    host: str,
    port: int,
    tls: ClientTls | None,
    deadline: float,
) -> UpstreamConn:
    """A connected `UpstreamConn` (made by `new`) to `host`:`port`. Raises UpstreamTimeout (the
    deadline passed, the handshake included), UpstreamTlsError, UpstreamConnectError."""
    try:
        async with asyncio.timeout_at(deadline):  # the TLS handshake included
            transport, proto = await loop.create_connection(
                new,
                host,
                port,
                ssl=None if tls is None else tls.context,
                server_hostname=None if tls is None else tls.server_hostname(host),
            )
    except TimeoutError:
        raise UpstreamTimeout("connect") from None
    except ssl.SSLError as e:
        raise handshake_failed(tls, f"{host}:{port}", e) from e
    except OSError as e:
        raise UpstreamConnectError(f"connect to {host}:{port}: {e}") from e
    proto.attach(transport)
    return proto
