"""Model routing of gRPC calls with real simulated backends and a grpcio client: the model a
call's first request message names (field 1, read without protos) picks the backend, for unary
and streaming calls alike, and a model nobody serves is NOT_FOUND from Sluice."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from gateway.proto import load
from tests.integration.backends_support import Sim, Spawn, start_gateway
from tests.support import until

pytestmark = pytest.mark.integration
pb2, pb2_grpc = load()
INFER = "/sluice.inference.v1.Inference/Infer"  # unary: its message comes with the call


def policy(llama: Sim, qwen: Sim) -> str:
    def grpc_addr(s: Sim) -> str:
        return f'{{address: "127.0.0.1:{s.grpc_port}"}}'

    return f"""\
limits: {{grpc_max_message_bytes: 65536}}
backends:
  - name: llama
    protocol: grpc
    endpoints: [{grpc_addr(llama)}]
    models: {{names: [llama-3]}}
    unary_methods: [{INFER}]
  - name: qwen
    protocol: grpc
    endpoints: [{grpc_addr(qwen)}]
    models: {{names: [qwen-7b]}}
    unary_methods: [{INFER}]
routes:
  - name: infer
    match: {{protocol: grpc, path_prefix: /sluice.inference.v1.Inference/}}
    backends: [{{backend: llama}}, {{backend: qwen}}]
    by_model: true
"""


async def test_grpc_calls_are_routed_by_model_name(tmp_path: Path, spawn: Spawn) -> None:
    llama, qwen = spawn(2, "--ttft-ms", "1", grpc=True)
    llama.knobs(models=["llama-3"])
    qwen.knobs(models=["qwen-7b"])
    gw = start_gateway(tmp_path, policy(llama, qwen))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as ch:
        stub = pb2_grpc.InferenceStub(ch)
        for model in ("qwen-7b", "llama-3") * 3:
            reply = await stub.Infer(pb2.InferRequest(model=model, prompt="hi"), timeout=5)
            assert reply.model == model
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Infer(pb2.InferRequest(model="gpt-4o", prompt="hi"), timeout=5)
        assert e.value.code() is grpc.StatusCode.NOT_FOUND
        assert "gpt-4o" in (e.value.details() or "")
    for sim in (llama, qwen):
        st = sim.stats()
        assert st["requests"].get("grpc Infer") == 3 and st["failed"] == 0
    gw.stop()


@pytest.mark.parametrize("engine", ["h2", "grpcio"])
async def test_streaming_calls_are_routed_by_their_first_message(
    tmp_path: Path, spawn: Spawn, engine: str
) -> None:
    """Server streaming, client streaming and bidi calls: the first request message's model
    picks the backend (that message reaches it first, the others after it); a model nobody
    serves is NOT_FOUND, a first message over the size limit RESOURCE_EXHAUSTED; a bidi call
    whose client waits past FIRST_MESSAGE_S before it writes is routed on its head and still
    served whole."""
    llama, qwen = spawn(2, "--ttft-ms", "1", grpc=True)
    gw = start_gateway(tmp_path, policy(llama, qwen), grpc_engine=engine)

    async def prompts(model: str) -> AsyncIterator[Any]:
        for p in ("a", "b", "c"):
            yield pb2.InferRequest(model=model, prompt=p)

    async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as ch:
        stub = pb2_grpc.InferenceStub(ch)
        for model in ("qwen-7b", "llama-3") * 2:
            req = pb2.InferRequest(model=model, prompt="x", max_tokens=2)
            assert len([c async for c in stub.Generate(req, timeout=5)]) == 2
            assert (await stub.Collect(prompts(model), timeout=5)).text.startswith("abc")
            chat = stub.Chat(timeout=5)
            for p in ("p1", "p2"):
                await chat.write(pb2.InferRequest(model=model, prompt=p))
                assert p in (await asyncio.wait_for(chat.read(), 5)).text
            await chat.done_writing()
            assert await chat.code() is grpc.StatusCode.OK
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _ = [c async for c in stub.Generate(pb2.InferRequest(model="gpt-4o"), timeout=5)]
        assert e.value.code() is grpc.StatusCode.NOT_FOUND

        async def too_big() -> AsyncIterator[Any]:
            yield pb2.InferRequest(model="qwen-7b", prompt="a" * 100_000)

        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Collect(too_big(), timeout=5)
        assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED  # the first message too

        def chats() -> int:
            return sum(sim.stats()["requests"].get("grpc Chat", 0) for sim in (llama, qwen))

        before = chats()
        late = stub.Chat(timeout=10)
        # With no message after FIRST_MESSAGE_S the gateway routes the call on its head.
        await until(chats, ok=lambda n: n == before + 1, what="the silent call at a member")
        await late.write(pb2.InferRequest(model="qwen-7b", prompt="late"))
        assert "late" in (await asyncio.wait_for(late.read(), 5)).text
        await late.done_writing()
        assert await late.code() is grpc.StatusCode.OK
    for sim in (llama, qwen):
        got = sim.stats()["requests"]
        assert got.get("grpc Generate") == 2, got
        # The oversized first message: refused before any member, unless reading it took longer
        # than FIRST_MESSAGE_S (a loaded machine) and the call was routed on its head first.
        assert got.get("grpc Collect") in (2, 3), got
        assert got.get("grpc Chat", 0) in (2, 3), got  # the late one: wherever its head went
        assert sim.stats()["failed"] == 0
    collects = sum(sim.stats()["requests"].get("grpc Collect", 0) for sim in (llama, qwen))
    assert collects in (4, 5)
    assert (
        llama.stats()["requests"].get("grpc Chat", 0) + qwen.stats()["requests"].get("grpc Chat", 0)
        == 5
    )
    gw.stop()
