"""Upstream gRPC channels: one owner for every grpc.aio channel Sluice opens to a backend.

A channel (one HTTP/2 connection) per endpoint address and TLS settings (`Endpoint.upstream_key`;
TLS credentials come built from the policy load), opened on first use and reused by every request
and across policy reloads. After a reload, `prune()` detaches the channels of endpoints the
policy no longer names (or whose channel options changed) and closes them after a grace, so
requests still running on the old snapshot finish. Unary-method discovery through the backend's
server reflection lives in `gateway.upstream.reflection` and is reached through `discover_unary`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from gateway.upstream.reflection import discover_unary_methods

if TYPE_CHECKING:
    from gateway.policy.compiled import Endpoint
    from gateway.policy.model import Limits

log = logging.getLogger("sluice.grpc.channels")

# Bounded caches of multicallables: method names come from clients, so an unbounded cache would
# let a client grow our memory by sending random method names. Past the bound we build per call.
MAX_CACHED_METHODS = 4096

Options = tuple[tuple[str, Any], ...]
UnaryCallable = Callable[..., grpc.aio.UnaryUnaryCall[bytes, bytes]]
StreamCallable = Callable[..., grpc.aio.StreamStreamCall[bytes, bytes]]


def channel_options(limits: Limits) -> Options:
    """Channel options for one upstream endpoint, derived from the policy limits."""
    return (
        # Sluice answers for retries itself (or not at all): a transparent retry of a
        # non-idempotent LLM call would double-charge the backend.
        ("grpc.enable_retries", 0),
        ("grpc.enable_channelz", 0),
        ("grpc.max_send_message_length", limits.grpc_max_message_bytes),
        ("grpc.max_receive_message_length", limits.grpc_max_message_bytes),
        # What a backend may send in one metadata block: more than the ingress accepts from
        # clients, so that a long status message (a stack trace in grpc-message) reaches the
        # client as the backend's code with trimmed details, not as RESOURCE_EXHAUSTED
        # ("received metadata size exceeds hard limit"). Soft and hard limit alike: between
        # them grpc rejects calls at random.
        ("grpc.max_metadata_size", limits.grpc_max_upstream_metadata_bytes),
        ("grpc.absolute_max_metadata_size", limits.grpc_max_upstream_metadata_bytes),
        # Pings every 5 min only while calls are active: grpc servers by default strike pings
        # closer than 5 min (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS), so this
        # never earns a GOAWAY(too_many_pings), and still finds a dead peer of a long stream.
        ("grpc.keepalive_time_ms", 300_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 0),
        # A restarted sidecar backend is back in ~1 s: do not sit in a 120 s backoff.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        # Each Sluice channel owns its connection (no sharing through the global subchannel
        # pool), so closing a pruned channel really closes its socket.
        ("grpc.use_local_subchannel_pool", 1),
        # Backpressure: the gateway only reads the next upstream message once the previous one
        # was accepted downstream; with BDP probing the channel's receive window grows to
        # megabytes and a backend could still pour a whole response into the gateway for a
        # client that reads nothing. A fixed 64 KiB stream window keeps it at one window.
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", 65536),
    )


class _Upstream:
    """One endpoint's channel plus its cached multicallables."""

    __slots__ = ("key", "address", "options", "channel", "unary", "stream")

    def __init__(self, endpoint: Endpoint, options: Options) -> None:
        self.key = endpoint.upstream_key
        self.address = endpoint.address
        self.options = options
        self.channel = open_channel(endpoint, options)
        self.unary: dict[str, UnaryCallable] = {}
        self.stream: dict[str, StreamCallable] = {}


def open_channel(endpoint: Endpoint, options: Options) -> grpc.aio.Channel:
    """A channel to `endpoint`: over TLS with its backend's credentials (built at policy load)
    when the backend has a `tls` section, else plaintext."""
    tls = endpoint.tls
    if tls is None:
        return grpc.aio.insecure_channel(endpoint.address, options=options)
    return grpc.aio.secure_channel(
        endpoint.address, tls.grpc_credentials, options=options + tls.grpc_options()
    )


class ChannelPool:
    """Upstream grpc.aio channels keyed by endpoint address; the gateway owns and closes it."""

    def __init__(self, limits: Limits) -> None:
        self._upstreams: dict[str, _Upstream] = {}
        self._closing: dict[asyncio.Task[None], grpc.aio.Channel] = {}
        self._options_now: Options = channel_options(limits)
        self._discovery_failed: set[str] = set()

    def configure(self, limits: Limits) -> None:
        """New limits from a reload: channels opened from now on use them (`prune` closes the
        ones whose options changed)."""
        self._options_now = channel_options(limits)

    def _options(self) -> Options:
        return self._options_now

    def _upstream(self, endpoint: Endpoint) -> _Upstream:
        up = self._upstreams.get(endpoint.upstream_key)
        if up is None:
            up = self._upstreams[endpoint.upstream_key] = _Upstream(endpoint, self._options())
        return up

    def get(self, endpoint: Endpoint) -> grpc.aio.Channel:
        """The channel of this endpoint, opened on first use."""
        return self._upstream(endpoint).channel

    def unary(self, endpoint: Endpoint, method: str) -> UnaryCallable:
        """A raw-bytes unary multicallable for `method` on this endpoint, cached."""
        up = self._upstream(endpoint)
        mc = up.unary.get(method)
        if mc is None:
            cache = len(up.unary) < MAX_CACHED_METHODS
            # A registered method saves core a per-call method-string lookup; its handle lives
            # as long as the channel, so only cached (bounded) methods are registered.
            mc = up.channel.unary_unary(method, None, None, _registered_method=cache)  # type: ignore[call-arg]
            if cache:
                up.unary[method] = mc
        return mc

    def stream(self, endpoint: Endpoint, method: str) -> StreamCallable:
        """A raw-bytes stream-stream multicallable for `method` on this endpoint, cached."""
        up = self._upstream(endpoint)
        mc = up.stream.get(method)
        if mc is None:
            cache = len(up.stream) < MAX_CACHED_METHODS
            mc = up.channel.stream_stream(method, None, None, _registered_method=cache)  # type: ignore[call-arg]
            if cache:
                up.stream[method] = mc
        return mc

    async def discover_unary(self, endpoint: Endpoint, timeout: float) -> set[str]:
        """Unary methods the endpoint's server reflection lists; empty on any failure (best
        effort: never raises; a failure is logged once per address until it succeeds again)."""
        try:
            found = await discover_unary_methods(self.get(endpoint), timeout)
        except Exception as e:  # a backend without (or with a broken) reflection is normal
            if endpoint.address not in self._discovery_failed:
                self._discovery_failed.add(endpoint.address)
                log.warning("unary discovery via reflection failed for %s: %r", endpoint.address, e)
            return set()
        self._discovery_failed.discard(endpoint.address)
        return found

    def state(self) -> dict[str, dict[str, str]]:
        """Per endpoint address: the channel's connectivity (IDLE, CONNECTING, READY,
        TRANSIENT_FAILURE), read without asking it to connect (for /admin/state)."""
        return {
            up.address: {"channel": up.channel.get_state(try_to_connect=False).name}
            for up in self._upstreams.values()
        }

    def addresses(self) -> set[str]:
        return {up.address for up in self._upstreams.values()}

    async def prune(self, wanted: set[str], grace: float) -> int:
        """Detach channels whose `Endpoint.upstream_key` (address and TLS settings) is not
        `wanted` any more, or whose options changed, and close them in the background after
        `grace` seconds, so calls still running on the old policy can finish. Returns how
        many."""
        options = self._options()
        stale = [
            up for key, up in self._upstreams.items() if key not in wanted or up.options != options
        ]
        for up in stale:
            del self._upstreams[up.key]
            task = asyncio.get_running_loop().create_task(up.channel.close(grace))
            self._closing[task] = up.channel
            task.add_done_callback(self._closed)
        if stale:
            log.info(
                "closing %d upstream gRPC channel(s): %s", len(stale), [u.address for u in stale]
            )
        return len(stale)

    def _closed(self, task: asyncio.Task[None]) -> None:
        self._closing.pop(task, None)

    async def aclose(self) -> None:
        """Close every channel now (pruned ones still in their grace too); calls still running
        are cancelled."""
        channels = [up.channel for up in self._upstreams.values()]
        self._upstreams = {}
        closing, self._closing = self._closing, {}
        for task, channel in closing.items():
            task.cancel()
            channels.append(channel)
        await asyncio.gather(*closing, return_exceptions=True)
        for channel in channels:
            await channel.close(None)
