"""HTTP/1.1 ingress on aiohttp's low-level `web.Server` (`listeners.http.engine: aiohttp`);
`gateway.adapters.engines.start_http` starts it when the policy names it.

The engine moves bytes only: each request is wrapped in an `AiohttpExchange` by `Handle`
(`gateway.adapters.aiohttp.exchange`, compiled) and handed to `HttpForward.serve`
(`gateway.forward.http`), which owns everything else: the chain, the header-total and body
bounds (431, 413), the upstream call through the pool, deadlines, the response phase and the
bookkeeping.

What this module adds to aiohttp's server, so that both engines answer the same bytes the same
way (`tests/adapters/test_differential.py` checks it):
- parser refusals: a header line over `max_line_bytes` (aiohttp's `max_line_size` /
  `max_field_size`, and `exchange.refusal`'s exact per-line bound) or more than `max_header_count`
  headers (aiohttp's `max_headers`) → 431 with a JSON body, connection closed; a request line
  over `max_line_bytes` gets the same 431 (aiohttp raises the same LineTooLong; 414 would need a
  guess). What the native parser refuses and aiohttp's accepts (CONNECT, a Transfer-Encoding
  other than one `chunked`, an upgrade request with a body) → 400. These are counted in
  `REJECTED` and never reach the forwarding path: no chain, no `finish`.
- a body found malformed after its request was handed on: the read fails (the forwarding path
  answers 400 `incomplete body`) and the connection closes, as on the native engine.
- header-read deadline: aiohttp 3.14 has none, so the handler class closes a connection that has
  not completed a request head within `header_read_s`, from accept and, on a keep-alive
  connection, from the first byte of each next head; aiohttp's `keepalive_timeout`
  (`keepalive_s`) closes connections idle between requests.
- client disconnect: `handler_cancellation=True` makes aiohttp cancel the handler task; the
  forwarding path then aborts the upstream request and records the request as cancelled.
- keep-alive timeout and parser limits are read from the policy when the listener starts; a
  reload changes them only for the next start.

Known aiohttp parser limits the native engine does not share (`tests/adapters/test_differential`):
a malformed request, or data after `Connection: close` or after a non-websocket upgrade, loses
the requests read together with it; a connection closed with input unread is reset (no lingering
close); the last trailer of a chunked body is added to the next request's headers.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_protocol import RequestHandler, _ErrInfo

from gateway.adapters.aiohttp.exchange import Handle, refusal
from gateway.forward.headers import JSON, error_body
from gateway.forward.http import HttpForward
from gateway.telemetry import metrics
from gateway.tls.listener import server_tls
from gateway.tls.material import identity

if TYPE_CHECKING:
    from gateway.app import Gateway

__all__ = ["HttpListener", "start_aiohttp"]


class _Handler(RequestHandler):
    """aiohttp's per-connection protocol, plus a header deadline, a cached peer and 431s.

    Header deadline: from accept, and on a keep-alive connection from the first byte of each
    next request, a complete request head must arrive within `header_read_s`, or the connection
    is closed (slowloris). aiohttp itself only bounds the time between requests, by
    `keepalive_timeout`, which a client that sends a byte now and then never reaches."""

    __slots__ = (
        "sluice_peer", "sluice_cert", "_header_deadline", "_header_timer", "_heads_before",
        "_head_due", "_max_line", "_mtls", "_last_payload",
    )  # fmt: skip

    def __init__(self, manager: _Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.sluice_peer = ""
        self.sluice_cert = ""  # mTLS identity of the client (gateway.tls.material)
        self._mtls = manager.mtls
        self._header_deadline = manager.header_read_s
        self._max_line = manager.max_line_bytes
        self._header_timer: asyncio.TimerHandle | None = None
        self._heads_before = -1  # heads parsed when the running deadline was armed
        self._head_due = 0.0  # when the head begun after those must be complete
        self._last_payload: StreamReader | None = None  # the body of the last request parsed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        self.sluice_peer = str(peer[0]) if peer else ""
        if self._mtls:  # the handshake is over: a certificate here was verified
            # (decoded once already, by the loop's SSL transport; None without one)
            self.sluice_cert = identity(transport.get_extra_info("peercert"))
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        # Idle between requests (aiohttp's loop waits for the next message): these bytes begin
        # the next request head, which gets header_read_s, like the first one.
        waiter = self._waiter
        if waiter is not None and not waiter.done() and self._heads_before != self._request_count:
            self._arm_header_deadline()  # (not again for more bytes of the same head)
        super().data_received(data)
        msgs = self._messages
        if not msgs:
            return
        for i, (msg, body) in enumerate(msgs):
            if not isinstance(msg, _ErrInfo):
                self._last_payload = body
                # What the native engine's parser refuses and aiohttp's accepts: 400/431, closed.
                err = refusal(msg, self._max_line)
                if err is not None:
                    msgs[i] = (_ErrInfo(status=400, exc=err, message=str(err)), EMPTY_PAYLOAD)
            else:
                # The body being read turned out malformed: aiohttp drops its payload without an
                # error (the handler would wait for it until a timeout, or take what came as the
                # whole body). Fail the read instead: the handler answers 400 `incomplete body`
                # and the connection closes after it, as on the native engine. Requests are
                # parsed in order, so the body is that of the last request parsed before the
                # error (running, or queued and not started yet).
                payload = self._last_payload
                if payload is not None and not payload.is_eof():
                    payload.set_exception(msg.exc)
                    payload.feed_eof()  # nothing more comes: aiohttp's lingering read is skipped
                    del msgs[i]
                    self.close()
                    return
                break

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)
        # The body holds this protocol (its flow control): a reference cycle, broken so that a
        # closed connection is freed at once rather than by the collector.
        self._last_payload = None

    def _arm_header_deadline(self) -> None:
        """The head now begun must be complete by `header_read_s` from now. One timer per
        connection, moved lazily: it is set only when none is pending, and a timer that fires
        before the latest deadline sets itself again for it (no timer made and cancelled per
        request)."""
        self._heads_before = self._request_count
        self._head_due = self._loop.time() + self._header_deadline
        if self._header_timer is None:
            self._header_timer = self._loop.call_at(self._head_due, self._header_expired)

    def _header_expired(self) -> None:
        self._header_timer = None
        if self._request_count != self._heads_before or self.transport is None:
            return  # the head came in time; the next one arms its own deadline
        if self._loop.time() >= self._head_due:
            self.transport.close()  # no complete request head in time (slowloris)
        else:  # a later head's deadline: wait for it
            self._header_timer = self._loop.call_at(self._head_due, self._header_expired)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:  # a bug of ours: aiohttp logs it with its traceback
            return super().handle_error(request, status, exc, message)
        # A malformed request (smuggling attempts included): answered in our JSON shape, counted,
        # not logged with a traceback (an attacker must not be able to flood the log).
        if isinstance(exc, LineTooLong) or (
            isinstance(exc, BadHttpMessage) and "Too many headers" in str(exc)
        ):
            status, kind, text = 431, "headers_too_large", "request header fields too large"
        else:
            kind, text = "bad_request", "malformed HTTP request"
        metrics.REJECTED.labels(kind, "http").inc()
        resp = web.Response(status=status, body=error_body(kind, text), content_type=JSON)
        resp.force_close()
        return resp


class _Server(web.Server):
    """`web.Server` that builds our handler class (aiohttp builds `RequestHandler` itself)."""

    def __init__(self, *args: Any, header_read_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_read_s = header_read_s
        self.max_line_bytes: int = kwargs["max_field_size"]
        self.mtls = False

    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class HttpListener:
    """A bound HTTP listener. `port` is the real port (useful with port 0)."""

    def __init__(self, runner: web.ServerRunner, site: web.TCPSite, server: _Server) -> None:
        self._runner = runner
        self._site: web.TCPSite | None = site
        self._server = server
        addrs = runner.addresses
        self.port: int = int(addrs[0][1]) if addrs else 0

    async def stop_accepting(self) -> None:
        """Close the listening socket; open connections keep being served."""
        if self._site is not None:
            site, self._site = self._site, None
            await site.stop()

    async def close(self, timeout: float) -> None:
        """Stop accepting, give in-flight handlers `timeout` seconds, then close everything."""
        await self.stop_accepting()
        self._server.pre_shutdown()
        await self._server.shutdown(timeout)
        await self._runner.cleanup()


async def start_aiohttp(
    gateway: Gateway, host: str, port: int, *, reuse_port: bool = False
) -> HttpListener:
    """Bind the aiohttp HTTP ingress. Parser limits and keep-alive come from the policy at start."""
    policy = gateway.active.policy.policy
    limits, timeouts = policy.limits, policy.timeouts
    server = _Server(
        Handle(HttpForward(gateway, asyncio.get_running_loop())),
        handler_cancellation=True,
        header_read_s=timeouts.header_read_s,
        keepalive_timeout=timeouts.keepalive_s,
        max_line_size=limits.max_line_bytes,
        max_field_size=limits.max_line_bytes,  # exact per-line bound: `refusal`
        max_headers=limits.max_header_count,
        access_log=None,
        auto_decompress=False,
    )
    runner = web.ServerRunner(server, handle_signals=False)
    await runner.setup()
    tls = server_tls(gateway.services, policy.listeners.http, http2=False)
    site: web.TCPSite
    if tls is None:
        site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None)
    else:
        server.mtls = tls.verifies_clients
        site = _TlsSite(
            runner,
            host,
            port,
            ssl_context=tls.context,
            handshake_timeout=timeouts.tls_handshake_s,
            reuse_port=reuse_port or None,
        )
    await site.start()
    return HttpListener(runner, site, server)


class _TlsSite(web.TCPSite):
    """`TCPSite` with a TLS handshake deadline (aiohttp's site passes none to create_server)."""

    __slots__ = ("_handshake_timeout",)

    def __init__(self, *args: Any, handshake_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handshake_timeout = handshake_timeout

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            server,
            self._host,
            self._port,
            ssl=self._ssl_context,
            ssl_handshake_timeout=self._handshake_timeout,
            backlog=self._backlog,
            reuse_port=self._reuse_port,
        )
        if self._server.sockets:
            self._bound_port = self._server.sockets[0].getsockname()[1]
