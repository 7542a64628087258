"""Model routing of gRPC calls with real simulated backends and a grpcio client: the model a
unary call's request message names (field 1, read without protos) picks the backend, and a
model nobody serves is NOT_FOUND from Sluice."""

from __future__ import annotations

from pathlib import Path

import grpc
import grpc.aio
import pytest

from gateway.proto import load
from tests.integration.backends_support import Spawn, start_gateway

pytestmark = pytest.mark.integration
pb2, pb2_grpc = load()
INFER = "/sluice.inference.v1.Inference/Infer"  # unary: its message comes with the call


async def test_grpc_calls_are_routed_by_model_name(tmp_path: Path, spawn: Spawn) -> None:
    llama, qwen = spawn(2, "--ttft-ms", "1", grpc=True)
    llama.knobs(models=["llama-3"])
    qwen.knobs(models=["qwen-7b"])

    def grpc_addr(s: object) -> str:
        return f'{{address: "127.0.0.1:{s.grpc_port}"}}'  # type: ignore[attr-defined]

    gw = start_gateway(
        tmp_path,
        f"""\
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
""",
    )
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
