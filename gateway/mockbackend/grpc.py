"""gRPC face of the simulated backend (grpc.aio): the sluice.inference.v1.Inference service
(Infer unary, Generate server-streaming, Collect client-streaming, Chat bidi), grpc.health.v1 and
server reflection, so a gateway can health-check it and learn which methods are unary.

Test hooks carried in request metadata: every `x-echo-*` key comes back as initial and trailing
metadata; `x-mock-sleep-ms: N` delays Infer by N ms (deadline tests); `x-mock-status: CODE` aborts
the call with that numeric status and details "mock failure" (padded to `x-mock-details-bytes: N`
characters when given, up to 1 MiB: a huge grpc-message). Trailing metadata always carries the
total token count under the `usage_trailer` knob (default `x-mock-usage-tokens`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import _async as health_aio  # what `health.aio` re-exports
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.mockbackend.knobs import (
    Call,
    Knobs,
    MockState,
    Seen,
    completion_count,
    estimate_tokens,
    serves,
)
from gateway.mockbackend.knobs import token_text as _token_text
from gateway.proto import load

if TYPE_CHECKING:
    from gateway.mockbackend.tls import ServerTls

pb2, pb2_grpc = load()
SERVICE_NAME: str = pb2.DESCRIPTOR.services_by_name["Inference"].full_name
_CODES = {code.value[0]: code for code in grpc.StatusCode}

Metadata = list[tuple[str, str | bytes]]


@dataclasses.dataclass(slots=True)
class _Ctx:
    """Per-call facts: the knobs snapshot, the raw metadata, what to echo, and tokens so far."""

    knobs: Knobs
    metadata: dict[str, str | bytes]
    echo: Metadata
    tokens: int = 0

    def trailers(self) -> Metadata:
        return [*self.echo, (self.knobs.usage_trailer, str(self.tokens))]


def _usage(prompt_tokens: int, completion_tokens: int) -> Any:
    return pb2.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


MAX_DETAILS_BYTES = 1 << 20  # bound of the x-mock-details-bytes hook


def _details(metadata: dict[str, str | bytes]) -> str:
    """ "mock failure", or padded to `x-mock-details-bytes` characters (a huge grpc-message)."""
    size = metadata.get("x-mock-details-bytes")
    if not isinstance(size, str) or not size.strip().isdigit():
        return "mock failure"
    n = min(int(size), MAX_DETAILS_BYTES)
    return ("mock failure " + "x" * n)[:n]


class InferenceServicer:
    """The Inference service; registered with the generated `add_InferenceServicer_to_server`."""

    def __init__(self, state: MockState) -> None:
        self._state = state

    async def _begin(self, context: grpc.aio.ServicerContext[Any, Any], call: Call) -> _Ctx:
        """Record the metadata keys (never values), echo `x-echo-*` to this caller, then apply
        x-mock-status and the failure knobs."""
        metadata: dict[str, str | bytes] = {}
        for key, value in context.invocation_metadata() or ():
            metadata[key.lower()] = value
        self._state.stats.seen.append(Seen.of(metadata.items()))
        echo: Metadata = [(k, v) for k, v in metadata.items() if k.startswith("x-echo-")]
        ctx = _Ctx(dataclasses.replace(self._state.knobs), metadata, echo)
        if echo:
            await context.send_initial_metadata(echo)
        status = metadata.get("x-mock-status")
        if isinstance(status, str) and status.strip().isdigit() and int(status) != 0:
            code = _CODES.get(int(status), grpc.StatusCode.UNKNOWN)
            await self._abort(context, call, ctx, code, _details(metadata))
        failure = ctx.knobs.failure
        if failure == "hang":
            await asyncio.Event().wait()  # until the client cancels or the server stops
        if failure == "unavailable" or (failure == "none" and self._state.draw_error()):
            await self._abort(context, call, ctx, grpc.StatusCode.UNAVAILABLE)
        if failure == "http_5xx":
            await self._abort(context, call, ctx, grpc.StatusCode.INTERNAL)
        return ctx

    async def _abort(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        call: Call,
        ctx: _Ctx,
        code: grpc.StatusCode,
        details: str = "mock failure",
    ) -> None:
        call.fail()
        await context.abort(code, details, trailing_metadata=tuple(ctx.trailers()))

    async def Infer(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:  # noqa: N802
        with self._state.stats.track("grpc Infer") as call:
            ctx = await self._begin(context, call)
            if not serves(ctx.knobs, request.model):  # as Triton answers an unknown model
                await self._abort(context, call, ctx, grpc.StatusCode.NOT_FOUND, "unknown model")
            async with self._state.slots.hold(ctx.knobs):
                sleep_ms = ctx.metadata.get("x-mock-sleep-ms")
                if isinstance(sleep_ms, str) and sleep_ms.strip().isdigit():
                    await asyncio.sleep(int(sleep_ms) / 1000)
                n = completion_count(ctx.knobs, request.max_tokens or None)
                await asyncio.sleep(
                    (ctx.knobs.ttft_ms + ctx.knobs.token_delay_ms * max(n - 1, 0)) / 1000
                )
                if ctx.knobs.failure == "reset":
                    await self._abort(context, call, ctx, grpc.StatusCode.UNAVAILABLE, "mock reset")
                prompt_tokens = estimate_tokens(request.prompt)
                ctx.tokens = prompt_tokens + n
                context.set_trailing_metadata(tuple(ctx.trailers()))
                text = "".join(_token_text(i) for i in range(n))
                return pb2.InferResponse(
                    model=request.model, text=text, usage=_usage(prompt_tokens, n)
                )

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:  # noqa: N802
        with self._state.stats.track("grpc Generate") as call:
            ctx = await self._begin(context, call)
            async with self._state.slots.hold(ctx.knobs):
                knobs = ctx.knobs
                n = completion_count(knobs, request.max_tokens or None)
                prompt_tokens = estimate_tokens(request.prompt)
                ctx.tokens = prompt_tokens
                await asyncio.sleep(knobs.ttft_ms / 1000)
                for i in range(n):
                    if i:
                        await asyncio.sleep(knobs.token_delay_ms / 1000)
                    ctx.tokens += 1
                    last = i == n - 1
                    if last:
                        context.set_trailing_metadata(tuple(ctx.trailers()))
                    chunk = pb2.GenerateChunk(text=_token_text(i), index=i)
                    if last:
                        chunk.usage.CopyFrom(_usage(prompt_tokens, n))
                    await context.write(chunk)
                    if knobs.failure == "reset":  # mid-stream: after the first chunk
                        break
                if knobs.failure == "reset":
                    await self._abort(context, call, ctx, grpc.StatusCode.UNAVAILABLE, "mock reset")
                if n == 0:
                    context.set_trailing_metadata(tuple(ctx.trailers()))
                    await context.write(pb2.GenerateChunk(usage=_usage(prompt_tokens, 0)))

    async def Collect(  # noqa: N802
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        """Echo: the answer is the prompts concatenated; completion tokens = prompt tokens."""
        with self._state.stats.track("grpc Collect") as call:
            ctx = await self._begin(context, call)
            model, parts = "", []
            async for req in request_iterator:
                model = req.model or model
                parts.append(req.prompt)
            text = "".join(parts)
            await asyncio.sleep(ctx.knobs.ttft_ms / 1000)
            if ctx.knobs.failure == "reset":
                await self._abort(context, call, ctx, grpc.StatusCode.UNAVAILABLE, "mock reset")
            tokens = estimate_tokens(text)
            ctx.tokens = 2 * tokens
            context.set_trailing_metadata(tuple(ctx.trailers()))
            return pb2.InferResponse(model=model, text=text, usage=_usage(tokens, tokens))

    async def Chat(  # noqa: N802
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        """Each request gets one chunk echoing its prompt, after ttft; usage sums both ways."""
        with self._state.stats.track("grpc Chat") as call:
            ctx = await self._begin(context, call)
            index = 0
            async for req in request_iterator:
                await asyncio.sleep(ctx.knobs.ttft_ms / 1000)
                tokens = estimate_tokens(req.prompt)
                ctx.tokens += 2 * tokens
                chunk = pb2.GenerateChunk(
                    text=req.prompt, index=index, usage=_usage(tokens, tokens)
                )
                await context.write(chunk)
                index += 1
                if ctx.knobs.failure == "reset":
                    await self._abort(context, call, ctx, grpc.StatusCode.UNAVAILABLE, "mock reset")
            context.set_trailing_metadata(tuple(ctx.trailers()))


class GrpcBackend:
    """Owns the grpc.aio server, its health servicer and reflection; `start` then `stop`."""

    def __init__(self, state: MockState) -> None:
        self._state = state
        self._health = health_aio.HealthServicer()
        # SO_REUSEPORT off: a port already taken must fail loudly, not be shared silently.
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(state), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self.server)
        names: Sequence[str] = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        state.on_change(self._sync_health)
        self.port = 0

    async def _sync_health(self, knobs: Knobs) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        status = serving if knobs.healthy else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)

    async def start(self, address: str, tls: ServerTls | None = None) -> int:
        if tls is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, tls.grpc_credentials())
        if self.port == 0:
            raise OSError(f"gRPC cannot listen on {address}")
        await self._sync_health(self._state.knobs)
        await self.server.start()
        return self.port

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace)
