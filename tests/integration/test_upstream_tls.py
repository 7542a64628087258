"""Upstream TLS end to end: a real gateway process in front of simulated backends that serve
HTTP and gRPC over TLS (one of them requiring client certificates), with a CA the test makes.
Each backend section of one policy reaches a backend one way: verified, mutual TLS, the wrong
CA, the wrong name, no client certificate, verification skipped."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import pytest

from gateway.proto import load
from tests.integration.backends_support import Gw, Sim, start_sims
from tests.integration.conftest import wait_ready
from tests.support import ROOT, Proc, free_port, until
from tests.tls_support import SERVER_NAME, Pki, make_pki

pytestmark = pytest.mark.integration

pb2, pb2_grpc = load()

HEALTH = "{interval_s: 0.5, failing_interval_s: 0.2, unhealthy_after: 1, healthy_after: 1}"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@dataclass
class Setup:
    pki: Pki
    tls: Sim  # HTTP + gRPC over TLS
    mtls: Sim  # the same, requiring a client certificate signed by the CA
    gw: Gw


def _policy(pki: Pki, tls: Sim, mtls: Sim, port: int, grpc_port: int, admin: int) -> str:
    ca, other = pki.ca.path, pki.other_ca.path
    verified = f"{{ca: {ca}, server_name: {SERVER_NAME}}}"
    mutual = (
        f"{{ca: {ca}, server_name: {SERVER_NAME}, cert: {pki.client.cert}, key: {pki.client.key}}}"
    )
    wrong_name = f"{{ca: {ca}, server_name: wrong.test}}"
    backends = [  # name, protocol, member, tls, health
        ("good-http", "http", tls.address, verified, True),
        ("good-grpc", "grpc", f"127.0.0.1:{tls.grpc_port}", verified, True),
        ("mtls-http", "http", mtls.address, mutual, True),
        ("mtls-grpc", "grpc", f"127.0.0.1:{mtls.grpc_port}", mutual, True),
        ("nocert-http", "http", mtls.address, verified, False),
        ("wrongca-http", "http", tls.address, f"{{ca: {other}, server_name: {SERVER_NAME}}}", 1),
        ("wrongca-grpc", "grpc", f"127.0.0.1:{tls.grpc_port}", f"{{ca: {other}}}", False),
        ("wrongname-http", "http", tls.address, wrong_name, False),
        ("insecure-http", "http", tls.address, "{insecure_skip_verify: true}", False),
        ("wrongname-grpc", "grpc", f"127.0.0.1:{tls.grpc_port}", wrong_name, False),
    ]
    lines = ["backends:"]
    routes = ["routes:"]
    for name, protocol, address, section, health in backends:
        lines += [
            f"  - name: {name}",
            f"    protocol: {protocol}",
            f'    endpoints: [{{address: "{address}"}}]',
            f"    tls: {section}",
        ]
        if health:
            lines.append(f"    health: {HEALTH}")
        if protocol == "grpc":
            lines.append("    unary_methods: [/sluice.inference.v1.Inference/Infer]")
            match = f"{{protocol: grpc, headers: [{{name: x-backend, value: {name}}}]}}"
            routes += [f"  - name: {name}", f"    match: {match}", f"    backend: {name}"]
        else:
            prefix = "/" + name.removesuffix("-http")
            routes += [
                f"  - name: {name}",
                f"    match: {{protocol: http, path_prefix: {prefix}/}}",
                f"    strip_prefix: {prefix}",
                f"    backend: {name}",
            ]
    return "\n".join(
        [
            "version: 1",
            "listeners:",
            f"  http: {{host: 127.0.0.1, port: {port}}}",
            f"  grpc: {{host: 127.0.0.1, port: {grpc_port}}}",
            f"  admin: {{host: 127.0.0.1, port: {admin}}}",
            "access_log: {enabled: true}",
            "timeouts: {connect_s: 2, first_byte_s: 5}",
            *lines,
            *routes,
            "",
        ]
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("upstream-tls")
    pki = make_pki(tmp / "pki")
    cert = ["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key)]
    fast = ["--ttft-ms", "5", "--token-delay-ms", "5"]
    (tls,) = start_sims(tmp, 1, *fast, *cert, grpc=True)
    client_ca = ["--tls-client-ca", str(pki.ca.path)]
    (mtls,) = start_sims(tmp, 1, *fast, *cert, *client_ca, grpc=True)
    port, grpc_port, admin = free_port(), free_port(), free_port()
    path = tmp / "policy.yaml"
    path.write_text(_policy(pki, tls, mtls, port, grpc_port, admin))
    proc = Proc(["serve", "--policy", str(path)], tmp / "gateway.log")
    gw = Gw(proc, path, port, admin, grpc_port)
    try:
        wait_ready(admin, gw.proc)
        yield Setup(pki, tls, mtls, gw)
    finally:
        gw.proc.stop()
        for s in (tls, mtls):
            s.proc.stop()


async def _chat(gw: Gw, prefix: str, **extra: Any) -> tuple[int, bytes]:
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        url = f"{gw.url}/{prefix}/v1/chat/completions"
        async with s.post(url, json={**CHAT, **extra}) as r:
            return r.status, await r.read()


async def _infer(gw: Gw, backend: str) -> Any:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as ch:
        stub = pb2_grpc.InferenceStub(ch)
        request = pb2.InferRequest(model="m", prompt="hi", max_tokens=3)
        return await stub.Infer(request, timeout=5, metadata=(("x-backend", backend),))


def _access_lines(gw: Gw, route: str) -> list[dict[str, Any]]:
    out = []
    for line in gw.proc.output().splitlines():
        if line.startswith("{") and f'"route":"{route}"' in line:
            out.append(json.loads(line))
    return out


async def test_json_and_sse_over_verified_tls(setup: Setup) -> None:
    status, body = await _chat(setup.gw, "good")
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 3
    status, body = await _chat(setup.gw, "good", stream=True)
    assert status == 200, body
    events = [e for e in body.decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 4, events


async def test_grpc_unary_and_streaming_over_tls(setup: Setup) -> None:
    reply = await _infer(setup.gw, "good-grpc")
    assert reply.usage.completion_tokens == 3
    async with grpc.aio.insecure_channel(f"127.0.0.1:{setup.gw.grpc_port}") as ch:
        stub = pb2_grpc.InferenceStub(ch)
        call = stub.Generate(
            pb2.InferRequest(prompt="x", max_tokens=4),
            timeout=5,
            metadata=(("x-backend", "good-grpc"),),
        )
        chunks = [c async for c in call]
    assert len(chunks) == 4 and chunks[-1].usage.total_tokens > 0


async def test_mutual_tls_with_a_client_certificate(setup: Setup) -> None:
    status, body = await _chat(setup.gw, "mtls")
    assert status == 200, body
    assert (await _infer(setup.gw, "mtls-grpc")).usage.completion_tokens == 3
    # Without a client certificate the backend ends the connection after the handshake.
    status, body = await _chat(setup.gw, "nocert")
    assert status == 502, body


async def test_health_checks_run_over_tls(setup: Setup) -> None:
    gw = setup.gw
    tls, mtls = setup.tls, setup.mtls

    def healthy(backend: str, address: str) -> bool | None:
        m = gw.member(backend, address)
        return None if m is None else m["health"]["healthy"] and m["health"]["checks"] > 0

    wanted = [
        ("good-http", tls.address),
        ("good-grpc", f"127.0.0.1:{tls.grpc_port}"),
        ("mtls-http", mtls.address),
        ("mtls-grpc", f"127.0.0.1:{mtls.grpc_port}"),
    ]
    await until(lambda: all(healthy(b, a) for b, a in wanted), 15)

    def refused() -> str:
        m = gw.member("wrongca-http", tls.address)
        h = m["health"] if m is not None else {}
        return str(h.get("last_error") or "") if h.get("healthy") is False else ""

    await until(lambda: "certificate verify failed" in refused(), 15)
    assert "unable to get local issuer certificate" in refused()


async def test_wrong_ca_is_502_with_the_reason_logged(setup: Setup) -> None:
    gw = setup.gw
    status, body = await _chat(gw, "wrongca")
    assert status == 502, body
    error = json.loads(body)["error"]
    assert error["type"] == "upstream_tls_error"
    assert "certificate verify failed: unable to get local issuer certificate" in error["message"]
    await until(lambda: _access_lines(gw, "wrongca-http"), 10)
    line = _access_lines(gw, "wrongca-http")[-1]
    assert line["status"] == 502 and line["error"] == "upstream_tls_error", line
    assert "certificate verify failed" in line["detail"], line
    log = gw.proc.output()
    assert f"upstream TLS with {setup.tls.address} failed: certificate verify failed" in log


async def test_wrong_ca_on_grpc_is_unavailable_with_the_reason_logged(setup: Setup) -> None:
    gw = setup.gw
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _infer(gw, "wrongca-grpc")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "CERTIFICATE_VERIFY_FAILED" in (e.value.details() or ""), e.value.details()
    await until(lambda: _access_lines(gw, "wrongca-grpc"), 10)
    line = _access_lines(gw, "wrongca-grpc")[-1]
    assert line["grpc_status"] == 14 and line["error"] == "upstream_tls_error", line
    assert "CERTIFICATE_VERIFY_FAILED" in line["detail"], line
    assert f"upstream TLS with 127.0.0.1:{setup.tls.grpc_port} failed" in gw.proc.output()


async def test_wrong_server_name_is_502(setup: Setup) -> None:
    status, body = await _chat(setup.gw, "wrongname")
    assert status == 502, body
    error = json.loads(body)["error"]
    assert error["type"] == "upstream_tls_error"
    assert "Hostname mismatch" in error["message"] and "wrong.test" in error["message"]


async def test_wrong_server_name_on_grpc_is_unavailable(setup: Setup) -> None:
    gw = setup.gw
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _infer(gw, "wrongname-grpc")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "Hostname Verification Check failed" in (e.value.details() or ""), e.value.details()
    await until(lambda: _access_lines(gw, "wrongname-grpc"), 10)
    line = _access_lines(gw, "wrongname-grpc")[-1]
    assert line["error"] == "upstream_tls_error", line
    assert line["detail"].startswith("Custom verification check failed"), line


async def test_insecure_skip_verify_connects_and_policy_check_warns(setup: Setup) -> None:
    status, body = await _chat(setup.gw, "insecure")
    assert status == 200, body
    # The gateway said so once, when it loaded the policy (not per member or per connection).
    entries = [json.loads(ln) for ln in setup.gw.proc.output().splitlines() if ln.startswith("{")]
    logged = [
        e["msg"]
        for e in entries
        if e.get("logger") == "sluice.policy" and "insecure_skip_verify" in e["msg"]
    ]
    assert len(logged) == 1, logged
    assert "backends[8].tls.insecure_skip_verify" in logged[0]
    assert "'insecure-http' does not verify" in logged[0]
    check = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "gateway", "policy", "check", str(setup.gw.policy)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    warnings = [line for line in check.stdout.splitlines() if ": warning: " in line]
    assert len(warnings) == 1, check.stdout
    assert "backends[8].tls.insecure_skip_verify" in warnings[0]
    assert "'insecure-http' does not verify" in warnings[0]


async def _reload(gw: Gw, text: str) -> tuple[int, Any]:
    tmp = gw.policy.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(gw.policy)
    timeout = aiohttp.ClientTimeout(total=30)
    url = f"http://127.0.0.1:{gw.admin_port}/admin/policy/reload"
    async with aiohttp.ClientSession(timeout=timeout) as s, s.post(url) as r:
        return r.status, await r.json()


async def test_reloads_read_the_files_and_a_changed_section_opens_new_connections(
    setup: Setup,
) -> None:
    """Last in this module: it edits the shared gateway's policy (and puts it back)."""
    gw = setup.gw
    original = gw.policy.read_text()
    verified = f"{{ca: {setup.pki.ca.path}, server_name: {SERVER_NAME}}}"
    assert original.count(verified) == 3  # good-http is the first
    try:
        assert (await _chat(gw, "good"))[0] == 200  # a verified keep-alive connection is idle
        # A file that cannot be read: the reload fails at its field, the old policy serves on.
        broken = original.replace(f"ca: {setup.pki.ca.path}", "ca: /nonexistent/ca.pem", 1)
        code, st = await _reload(gw, broken)
        assert code == 422, st
        errors = st["last_reload"]["errors"]
        assert any(
            f"{gw.policy}:" in e and "backends[0].tls.ca: cannot read /nonexistent" in e
            for e in errors
        ), errors
        assert (await _chat(gw, "good"))[0] == 200
        # A changed section gets new connections: the idle one, verified for the old name,
        # is not reused for a name the certificate does not carry.
        renamed = original.replace(verified, f"{{ca: {setup.pki.ca.path}, server_name: x.test}}", 1)
        code, st = await _reload(gw, renamed)
        assert code == 200 and st["last_reload"]["ok"], st
        status, body = await _chat(gw, "good")
        assert status == 502 and b"Hostname mismatch" in body, body
    finally:
        code, st = await _reload(gw, original)
        assert code == 200, st
    assert (await _chat(gw, "good"))[0] == 200
