"""The shipped default policy is safe to expose: a gateway on `policies/default.yaml` (ports
moved to free ones, routes exactly as shipped) forwards no `/admin/*` path to the simulated
backend, and no request header value ever comes back from any of the backend's endpoints."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml

from gateway.proto import load
from tests.integration.conftest import http_json, wait_ready
from tests.support import ROOT, Proc, free_port

pytestmark = pytest.mark.integration

pb2, pb2_grpc = load()


@dataclass
class DefaultGateway:
    proc: Proc
    http: int
    grpc: int
    mock_http: int
    mock_grpc: int
    mock_admin: int


def default_policy_on_free_ports(
    tmp: Path, pin_mock_admin: bool = True
) -> tuple[str, dict[str, int]]:
    """policies/default.yaml with every port replaced by a free one; nothing else changed
    (without `pin_mock_admin`, the simulated backend's admin API keeps its shipped default)."""
    doc = yaml.safe_load((ROOT / "policies" / "default.yaml").read_text())
    ports = {k: free_port() for k in ("http", "grpc", "admin", "mhttp", "mgrpc", "madmin")}
    for name in ("http", "grpc", "admin"):
        doc["listeners"][name]["port"] = ports[name]
    doc["listeners"]["http"]["host"] = doc["listeners"]["grpc"]["host"] = "127.0.0.1"
    mock = doc["mock_backend"]
    old = {mock["http"]: f"127.0.0.1:{ports['mhttp']}", mock["grpc"]: f"127.0.0.1:{ports['mgrpc']}"}
    mock["http"], mock["grpc"] = old[mock["http"]], old[mock["grpc"]]
    if pin_mock_admin:
        mock["admin"] = f"127.0.0.1:{ports['madmin']}"
    for backend in doc["backends"]:
        for endpoint in backend["endpoints"]:
            endpoint["address"] = old[endpoint["address"]]
    path = tmp / "default.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path), ports


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DefaultGateway]:
    tmp = tmp_path_factory.mktemp("default-policy")
    path, p = default_policy_on_free_ports(tmp)
    proc = Proc(["serve", "--policy", path], tmp / "gateway.log")
    try:
        wait_ready(p["admin"], proc)
        yield DefaultGateway(proc, p["http"], p["grpc"], p["mhttp"], p["mgrpc"], p["madmin"])
    finally:
        assert proc.stop() == 0, proc.output()


ADMIN_ATTEMPTS = [
    ("GET", "/admin/stats"),
    ("GET", "/admin/knobs"),
    ("POST", "/admin/knobs"),
    ("POST", "/admin/reset"),
    ("GET", "//admin/stats"),
    ("GET", "/v1/../admin/stats"),
    ("GET", "/v1/%2e%2e/admin/stats"),
    ("GET", "/ADMIN/stats"),
]


async def test_default_policy_forwards_no_admin_path(gw: DefaultGateway) -> None:
    async with aiohttp.ClientSession() as s:
        base = f"http://127.0.0.1:{gw.http}"
        for method, path in ADMIN_ATTEMPTS:
            patch = {"failure": "http_5xx", "healthy": False}
            async with s.request(method, base + path, json=patch, skip_auto_headers=()) as r:
                assert r.status in (400, 404), (method, path, r.status)
                assert "failure" not in await r.text()
        # What the default policy is for still works...
        async with s.get(base + "/v1/models") as r:
            assert r.status == 200
        async with s.get(base + "/healthz") as r:
            assert r.status == 200
        # ...and the backend's knobs are as they started (read on its loopback admin listener).
        async with s.get(f"http://127.0.0.1:{gw.mock_admin}/admin/knobs") as r:
            knobs = await r.json()
    assert knobs["failure"] == "none" and knobs["healthy"] is True


async def test_the_backend_answers_the_admin_api_on_its_own_listener_only(
    gw: DefaultGateway,
) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{gw.mock_http}/admin/stats") as r:
            assert r.status == 404
        async with s.get(f"http://127.0.0.1:{gw.mock_admin}/admin/stats") as r:
            assert r.status == 200 and "seen" in await r.json()


def _secrets() -> dict[str, str]:
    """Header name -> a value seen nowhere else (a uuid each)."""
    names = ("authorization", "proxy-authorization", "cookie", "x-api-key", "x-custom")
    return {name: f"v{uuid.uuid4().hex}" for name in names}


async def _http_calls(s: aiohttp.ClientSession, base: str, headers: dict[str, str]) -> list[str]:
    """Every HTTP endpoint of the backend, called with `headers`; each full response as text."""
    texts = []
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    calls: list[tuple[str, str, Any]] = [
        ("POST", "/v1/chat/completions", chat),
        ("POST", "/v1/chat/completions", chat | {"stream": True}),
        ("POST", "/v1/completions", {"prompt": "p", "max_tokens": 2}),
        ("POST", "/v1/completions", {"prompt": "p", "stream": True, "max_tokens": 2}),
        ("POST", "/v1/chat/completions", {"messages": "not a list"}),
        ("GET", "/v1/models", None),
        ("GET", "/healthz", None),
        ("GET", "/healthz?deep=true", None),
        ("GET", "/metrics", None),
        ("GET", "/nowhere", None),
    ]
    for method, path, body in calls:
        async with s.request(method, base + path, json=body, headers=headers) as r:
            texts.append(f"{r.status} {dict(r.headers)} {await r.text()}")
    return texts


async def _grpc_calls(target: str, metadata: dict[str, str]) -> list[str]:
    md = tuple(metadata.items())
    texts = []
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb2_grpc.InferenceStub(ch)
        call = stub.Infer(pb2.InferRequest(prompt="hi", max_tokens=2), metadata=md, timeout=10)
        reply = await call
        texts.append(f"{reply} {await call.initial_metadata()} {await call.trailing_metadata()}")
        stream = stub.Generate(pb2.InferRequest(prompt="x", max_tokens=2), metadata=md, timeout=10)
        chunks = [str(c) async for c in stream]
        texts.append(
            f"{chunks} {await stream.initial_metadata()} {await stream.trailing_metadata()}"
        )
        failing = stub.Infer(
            pb2.InferRequest(prompt="x"), metadata=(*md, ("x-mock-status", "13")), timeout=10
        )
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await failing
        texts.append(f"{e.value.details()} {e.value.trailing_metadata()}")
    return texts


async def test_no_request_header_value_comes_back_from_any_backend_endpoint(
    gw: DefaultGateway,
) -> None:
    secrets = _secrets()
    texts: list[str] = []
    async with aiohttp.ClientSession() as s:
        # Through the gateway and straight at the backend, HTTP and gRPC.
        texts += await _http_calls(s, f"http://127.0.0.1:{gw.http}", secrets)
        texts += await _http_calls(s, f"http://127.0.0.1:{gw.mock_http}", secrets)
        texts += await _grpc_calls(f"127.0.0.1:{gw.grpc}", secrets)
        texts += await _grpc_calls(f"127.0.0.1:{gw.mock_grpc}", secrets)
        # Then everything the admin listener can show, the reset answer last.
        admin = f"http://127.0.0.1:{gw.mock_admin}"
        for method, path in [("GET", "/admin/stats"), ("GET", "/admin/knobs")]:
            async with s.request(method, admin + path) as r:
                assert r.status == 200
                texts.append(await r.text())
        stats = json.loads(texts[-2])
        async with s.post(admin + "/admin/reset") as r:
            texts.append(await r.text())
    # The backend did see those requests, by header name...
    names = {n for seen in stats["seen"] for n in seen["names"]}
    assert set(secrets) <= names, names
    # ...and not one value came back, in any header or body.
    blob = "\n".join(texts)
    leaked = [name for name, value in secrets.items() if value in blob]
    assert not leaked, leaked


SIMULATED = re.compile(r"simulated backend on http:\d+ grpc:\d+ admin:(\d+)")


def test_two_gateways_with_the_simulated_backend_run_at_once(tmp_path: Path) -> None:
    """The shipped policy leaves the simulated backend's admin port to the system: two
    gateways (other ports moved apart) both start, each with its own admin API."""
    procs, admins = [], []
    try:
        for i in range(2):
            tmp = tmp_path / str(i)
            tmp.mkdir()
            path, ports = default_policy_on_free_ports(tmp, pin_mock_admin=False)
            procs.append(Proc(["serve", "--policy", path], tmp / "gateway.log"))
            admins.append(ports["admin"])
        for proc, admin in zip(procs, admins, strict=True):
            wait_ready(admin, proc)
        mock_admins = []
        for proc in procs:
            found = SIMULATED.search(proc.output())
            assert found, proc.output()
            mock_admins.append(int(found.group(1)))
        assert len(set(mock_admins)) == 2 and 0 not in mock_admins
        for port in mock_admins:
            assert http_json(f"http://127.0.0.1:{port}/admin/knobs")["failure"] == "none"
    finally:
        codes = [proc.stop() for proc in procs]
    assert codes == [0, 0], [proc.output() for proc in procs]
