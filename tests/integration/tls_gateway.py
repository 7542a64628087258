"""A gateway process whose listeners serve TLS with a private CA's certificate, and the clients
the TLS tests use (stdlib HTTPS, grpcio over a secure channel)."""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gateway.proto import inference_pb2
from tests.integration.conftest import Backend, policy_yaml, wait_ready
from tests.support import Proc, free_port
from tests.tls_support import Issued, TestCA, replace_atomically

INFER = "/sluice.inference.v1.Inference/Infer"
CHAT = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
# What the simulated backend answers (its tokens cycle through fixed words): CHAT gets these
# three, and grpc_infer's request ("hi", at most 2 tokens) exactly INFER_REPLY.
CHAT_CONTENT = "sluice gates hold "
INFER_REPLY = inference_pb2.InferResponse(
    model="m",
    text="sluice gates ",
    usage=inference_pb2.Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3),
)


@dataclass
class TlsGateway:
    proc: Proc
    policy: Path
    http_port: int
    grpc_port: int
    admin_port: int
    ca: TestCA
    served: Issued  # the certificate the files hold now
    cert: Path  # the paths the policy names
    key: Path
    engine: str = "native"  # listeners.http.engine

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.admin}{path}", timeout=5) as r:
            return r.read()

    def readyz(self) -> Any:
        return json.loads(self.get("/readyz"))


def tls_block(cert: Path, key: Path, ca: Path | None = None, mode: str = "off") -> str:
    extra = f", client_ca: {ca}, client_cert: {mode}" if ca is not None else ""
    return f"{{cert: {cert}, key: {key}{extra}}}"


def start_tls_gateway(
    backend: Backend,
    tmp: Path,
    engine: str,
    *,
    http_tls: str | None = None,
    grpc_tls: str | None = None,
    tail: str = "",
    ca: TestCA | None = None,
    workers: int = 1,
    grpc_engine: str = "h2",  # listeners.grpc.engine (the default)
) -> TlsGateway:
    """A gateway whose HTTP and gRPC listeners serve TLS with a certificate of `ca`."""
    ca = ca or TestCA(tmp / "ca")
    served = ca.server()
    cert, key = tmp / "tls.crt", tmp / "tls.key"
    replace_atomically(served.cert, cert)
    replace_atomically(served.key, key)
    http, grpc_port, admin = free_port(), free_port(), free_port()
    text = policy_yaml(
        backend, http, grpc_port, admin, engine=engine, tail=tail, grpc_engine=grpc_engine,
        timeouts="first_byte_s: 5\n  drain_s: 5\n  tls_handshake_s: 2",
    )  # fmt: skip
    text = text.replace(
        f"engine: {engine}}}", f"engine: {engine}, tls: {http_tls or tls_block(cert, key)}}}"
    ).replace(
        f"port: {grpc_port}, ", f"port: {grpc_port}, tls: {grpc_tls or tls_block(cert, key)}, "
    )
    policy = tmp / "policy.yaml"
    policy.write_text(text)
    proc = Proc(
        ["serve", "--policy", str(policy), "--workers", str(workers)],
        tmp / "gateway.log",
        env={"SLUICE_WATCH_INTERVAL": "0.2", "SLUICE_TLS_WATCH_INTERVAL": "0.2"},
    )
    try:
        wait_ready(admin, proc)
    except BaseException:
        proc.stop()
        raise
    return TlsGateway(proc, policy, http, grpc_port, admin, ca, served, cert, key, engine)


def https(gw: TlsGateway, ctx: ssl.SSLContext | None = None) -> http.client.HTTPSConnection:
    return http.client.HTTPSConnection(
        "localhost", gw.http_port, context=ctx or gw.ca.client_context(), timeout=5
    )


def post_chat(conn: http.client.HTTPConnection) -> tuple[int, bytes]:
    headers = {"content-type": "application/json"}
    conn.request("POST", "/v1/chat/completions", json.dumps(CHAT), headers)
    r = conn.getresponse()
    return r.status, r.read()


def check_chat_answer(answer: Any) -> None:
    """`answer` (a decoded JSON body) is the backend's whole answer to CHAT."""
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-"), answer
    assert answer["model"] == "m", answer
    assert answer["choices"] == [
        {
            "index": 0,
            "finish_reason": "length",
            "message": {"role": "assistant", "content": CHAT_CONTENT},
        }
    ], answer
    usage = answer["usage"]
    assert usage["completion_tokens"] == 3 and usage["prompt_tokens"] >= 1, usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + 3, usage


def grpc_infer(port: int, ca: TestCA, client: Issued | None = None) -> Any:
    creds = grpc.ssl_channel_credentials(
        ca.path.read_bytes(),
        client.key.read_bytes() if client else None,
        client.cert.read_bytes() if client else None,
    )
    with grpc.secure_channel(f"localhost:{port}", creds) as ch:
        call = ch.unary_unary(
            INFER,
            request_serializer=inference_pb2.InferRequest.SerializeToString,
            response_deserializer=inference_pb2.InferResponse.FromString,
        )
        return call(inference_pb2.InferRequest(model="m", prompt="hi", max_tokens=2), timeout=10)
