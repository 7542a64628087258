"""gRPC surface: the four Inference methods, metadata echo and usage trailer, test hooks,
health, reflection, failure knobs and cancellation, with the generated stubs over real sockets."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway.mockbackend import MockBackendHandle
from gateway.proto import load
from tests.support import until

pb2, pb2_grpc = load()


def _md(metadata: Any) -> dict[str, Any]:
    return {k: v for k, v in metadata}


async def test_infer_echoes_metadata_and_usage(channel: grpc.aio.Channel) -> None:
    stub = pb2_grpc.InferenceStub(channel)
    call = stub.Infer(
        pb2.InferRequest(model="m", prompt="12345678"),
        metadata=(("x-echo-tenant", "acme"), ("x-other", "no")),
    )
    resp = await call
    assert resp.model == "m" and len(resp.text.split()) == 4
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (2, 4)
    assert resp.usage.total_tokens == 6
    initial, trailing = _md(await call.initial_metadata()), _md(await call.trailing_metadata())
    assert initial.get("x-echo-tenant") == "acme" and "x-other" not in initial
    assert trailing["x-echo-tenant"] == "acme"
    assert trailing["x-mock-usage-tokens"] == "6"


async def test_generate_streams_with_usage_last(
    backend: MockBackendHandle, channel: grpc.aio.Channel
) -> None:
    await backend.update_knobs({"completion_tokens": 5, "usage_trailer": "x-usage"})
    call = pb2_grpc.InferenceStub(channel).Generate(pb2.InferRequest(prompt="abcd", max_tokens=3))
    chunks = [c async for c in call]
    assert [c.index for c in chunks] == [0, 1, 2]
    assert not any(c.HasField("usage") for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 3 and chunks[-1].usage.total_tokens == 4
    assert _md(await call.trailing_metadata())["x-usage"] == "4"


async def test_collect_concatenates(channel: grpc.aio.Channel) -> None:
    async def prompts() -> AsyncIterator[Any]:
        for p in ("ab", "cd", "efgh"):
            yield pb2.InferRequest(model="m", prompt=p)

    call = pb2_grpc.InferenceStub(channel).Collect(prompts())
    resp = await call
    assert resp.text == "abcdefgh" and resp.model == "m"
    assert resp.usage.prompt_tokens == 2 and resp.usage.total_tokens == 4
    assert _md(await call.trailing_metadata())["x-mock-usage-tokens"] == "4"


async def test_chat_echoes_each_request(channel: grpc.aio.Channel) -> None:
    call = pb2_grpc.InferenceStub(channel).Chat()
    replies = []
    for prompt in ("hello", "again"):
        await call.write(pb2.InferRequest(prompt=prompt))
        replies.append(await call.read())
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF  # type: ignore[attr-defined]  # grpc-stubs lacks EOF
    assert [(r.text, r.index) for r in replies] == [("hello", 0), ("again", 1)]
    assert await call.code() == grpc.StatusCode.OK


async def test_mock_status_aborts(channel: grpc.aio.Channel) -> None:
    stub = pb2_grpc.InferenceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Infer(pb2.InferRequest(), metadata=(("x-mock-status", "8"),))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == "mock failure"
    assert _md(err.value.trailing_metadata())["x-mock-usage-tokens"] == "0"


async def test_mock_sleep_hits_deadline(channel: grpc.aio.Channel) -> None:
    stub = pb2_grpc.InferenceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Infer(pb2.InferRequest(), metadata=(("x-mock-sleep-ms", "2000"),), timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_health_follows_knob(backend: MockBackendHandle, channel: grpc.aio.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    assert (await stub.Check(health_pb2.HealthCheckRequest())).status == serving
    request = health_pb2.HealthCheckRequest(service="sluice.inference.v1.Inference")
    assert (await stub.Check(request)).status == serving
    await backend.update_knobs({"healthy": False})
    assert (await stub.Check(request)).status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_reflection_lists_services(channel: grpc.aio.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    await call.done_writing()
    reply = await call.read()
    names = {s.name for s in reply.list_services_response.service}
    assert {"sluice.inference.v1.Inference", "grpc.health.v1.Health"} <= names
    assert await call.read() == grpc.aio.EOF  # type: ignore[attr-defined]  # grpc-stubs lacks EOF


@pytest.mark.parametrize(
    ("failure", "code"),
    [("unavailable", grpc.StatusCode.UNAVAILABLE), ("http_5xx", grpc.StatusCode.INTERNAL)],
)
async def test_failure_knobs(
    backend: MockBackendHandle, channel: grpc.aio.Channel, failure: str, code: grpc.StatusCode
) -> None:
    await backend.update_knobs({"failure": failure})
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pb2_grpc.InferenceStub(channel).Infer(pb2.InferRequest())
    assert err.value.code() == code
    # the status reaches the client before the handler has unwound and counted the call
    await until(lambda: backend.stats.failed == 1)


async def test_hang_then_deadline_counts_cancelled(
    backend: MockBackendHandle, channel: grpc.aio.Channel
) -> None:
    await backend.update_knobs({"failure": "hang"})
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pb2_grpc.InferenceStub(channel).Infer(pb2.InferRequest(), timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await until(lambda: backend.stats.cancelled == 1)


async def test_reset_mid_stream(backend: MockBackendHandle, channel: grpc.aio.Channel) -> None:
    await backend.update_knobs({"failure": "reset"})
    call = pb2_grpc.InferenceStub(channel).Generate(pb2.InferRequest())
    first = await call.read()
    assert first.index == 0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_client_cancel_is_counted(
    backend: MockBackendHandle, channel: grpc.aio.Channel
) -> None:
    await backend.update_knobs({"completion_tokens": 1000, "token_delay_ms": 20})
    call = pb2_grpc.InferenceStub(channel).Generate(pb2.InferRequest(prompt="p"))
    await call.read()
    assert call.cancel()
    assert await call.code() == grpc.StatusCode.CANCELLED
    await until(lambda: backend.stats.cancelled == 1)
    assert backend.stats.in_flight == 0 and backend.stats.requests["grpc Generate"] == 1
