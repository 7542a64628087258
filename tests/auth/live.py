"""Helpers for the live JWT suites: the policy under test, a gateway process serving it, and raw
HTTP / gRPC clients that can send what a normal client would refuse to (two Authorization
headers, 1 MiB values)."""

from __future__ import annotations

import http.client
import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gateway.proto import load
from tests.auth import mint
from tests.integration.conftest import Backend, wait_ready
from tests.support import Proc, free_port, metric_total

pb2, pb2_grpc = load()

ALT_ISSUER = "https://alt.example/"
SECRET_ENV = "SLUICE_TEST_HS_SECRET"
GRPC_OF_HTTP = {
    200: grpc.StatusCode.OK,
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    431: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def policy(
    backend: Backend,
    ports: dict[str, int],
    jwks_url: str,
    alt_file: Path,
    engine: str = "aiohttp",
    cache_s: float = 600,
    cooldown_s: float = 30,
    timeout_s: float = 2,
    extra_route: str = "",
    recorder: int | None = None,
) -> str:
    routes = [
        ("grpc-gold", "{protocol: grpc, headers: [{name: x-route, value: gold}]}", "sim-grpc",
         "{required: true, claims: {tier: [gold, silver]}}"),
        ("grpc-optional", "{protocol: grpc, headers: [{name: x-route, value: optional}]}",
         "sim-grpc", "optional"),
        ("grpc-internal", "{protocol: grpc, headers: [{name: x-route, value: internal}]}",
         "sim-grpc", "{providers: [internal]}"),
        ("grpc-open", "{protocol: grpc, headers: [{name: x-route, value: open}]}", "sim-grpc",
         "off"),
        ("grpc", "{protocol: grpc}", "sim-grpc", "required"),
    ]  # fmt: skip
    text = "".join(
        f"  - name: {n}\n    match: {m}\n    backend: {b}\n    auth: {a}\n" for n, m, b, a in routes
    )
    for name, auth in [
        ("gold", "{required: true, claims: {tier: [gold, silver]}}"),
        ("optional", "optional"),
        ("internal", "{providers: [internal]}"),
        ("open", "off"),
    ]:
        text += (
            f"  - name: {name}\n    match: {{protocol: http, path_prefix: /{name}/}}\n"
            f"    backend: sim-http\n    strip_prefix: /{name}\n    auth: {auth}\n"
        )
    text += extra_route
    rec_backend = ""
    if recorder is not None:  # a test backend that records header values (the simulated one
        # keeps names only), behind routes with each auth mode
        rec_backend = (
            f"  - name: rec\n    protocol: http\n"
            f'    endpoints: [{{address: "127.0.0.1:{recorder}"}}]\n'
        )
        for name, auth in (("rec-open", "off"), ("rec-optional", "optional"), ("rec", "required")):
            text += (
                f"  - name: {name}\n    match: {{protocol: http, path_prefix: /{name}/}}\n"
                f"    backend: rec\n    strip_prefix: /{name}\n    auth: {auth}\n"
            )
    text += "  - name: openai\n    match: {protocol: http, path_prefix: /}\n"
    text += "    backend: sim-http\n    auth: required\n"
    grpc_engine = "grpcio" if engine == "aiohttp" else "h2"  # both gRPC engines in the suites
    return f"""\
version: 1
listeners:
  http: {{host: 127.0.0.1, port: {ports["http"]}, engine: {engine}}}
  grpc: {{host: 127.0.0.1, port: {ports["grpc"]}, engine: {grpc_engine}}}
  admin: {{host: 127.0.0.1, port: {ports["admin"]}}}
limits:
  max_header_bytes: 131072
  max_line_bytes: 65536
  grpc_max_metadata_bytes: 65536
timeouts: {{first_byte_s: 5, drain_s: 5}}
backends:
  - name: sim-http
    protocol: http
    endpoints: [{{address: "127.0.0.1:{backend.http_port}"}}]
  - name: sim-grpc
    protocol: grpc
    endpoints: [{{address: "127.0.0.1:{backend.grpc_port}"}}]
    unary_methods: [/sluice.inference.v1.Inference/Infer]
{rec_backend}auth:
  max_token_bytes: 32768
  providers:
    - name: corp
      issuer: "{mint.ISSUER}"
      audiences: [{mint.AUDIENCE}]
      algorithms: [RS256, ES256]
      jwks:
        url: "{jwks_url}"
        cache_s: {cache_s}
        unknown_kid_cooldown_s: {cooldown_s}
        timeout_s: {timeout_s}
      forward_claims: {{sub: x-sluice-user, tenant: x-sluice-tenant}}
    - name: internal
      issuer: {mint.HS_ISSUER}
      audiences: [{mint.AUDIENCE}]
      algorithms: [HS256]
      secret: {{env: {SECRET_ENV}}}
      forward_claims: {{sub: x-sluice-user}}
    - name: alt
      issuer: "{ALT_ISSUER}"
      audiences: [{mint.AUDIENCE}]
      algorithms: [PS256, RS256, ES384, ES256]
      jwks: {{file: "{alt_file}"}}
routes:
{text}"""


@dataclass
class LiveGateway:
    proc: Proc
    policy_path: Path
    ports: dict[str, int]

    def http(
        self, path: str, headers: list[tuple[str, str]] | None = None, timeout: float = 10
    ) -> tuple[int, dict[str, str], bytes]:
        """GET `path` with exactly these headers (repeats kept); (status, headers, body)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.ports["http"], timeout=timeout)
        try:
            conn.putrequest("GET", path)
            for k, v in headers or []:
                conn.putheader(k, v)
            conn.endheaders()
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def grpc(
        self, metadata: list[tuple[str, str]], timeout: float = 10
    ) -> tuple[grpc.StatusCode, dict[str, str]]:
        """A unary Infer with this metadata: (code, trailing metadata)."""
        with grpc.insecure_channel(f"127.0.0.1:{self.ports['grpc']}") as ch:
            stub = pb2_grpc.InferenceStub(ch)
            try:
                _, call = stub.Infer.with_call(
                    pb2.InferRequest(model="m", prompt="hi"), metadata=metadata, timeout=timeout
                )
                return grpc.StatusCode.OK, dict(call.trailing_metadata() or ())
            except grpc.RpcError as e:
                return e.code(), dict(e.trailing_metadata() or ())  # type: ignore[attr-defined]

    def admin(self, path: str) -> Any:
        url = f"http://127.0.0.1:{self.ports['admin']}{path}"
        with urllib.request.urlopen(url, timeout=5) as r:
            body = r.read()
        return json.loads(body) if path != "/metrics" else body.decode()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        return metric_total(self.admin("/metrics"), name, **labels)

    def reload(self) -> Any:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.ports['admin']}/admin/policy/reload", method="POST", data=b""
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def stop(self) -> str:
        out = self.proc.output()
        assert self.proc.stop() == 0, out
        return out


def start(tmp: Path, text_of: Any, env: dict[str, str] | None = None) -> LiveGateway:
    ports = {"http": free_port(), "grpc": free_port(), "admin": free_port()}
    path = tmp / "policy.yaml"
    path.write_text(text_of(ports))
    proc = Proc(
        ["serve", "--policy", str(path)],
        tmp / "gateway.log",
        env={SECRET_ENV: mint.HS_SECRET.decode(), "SLUICE_WATCH_INTERVAL": "0.2", **(env or {})},
    )
    wait_ready(ports["admin"], proc)
    return LiveGateway(proc, path, ports)


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]
