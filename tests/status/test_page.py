"""The status page in a real headless Chromium, in front of a real gateway and two real
simulated backends: it renders, shows the colour and every backend member, and updates by itself
when a backend is killed. Screenshots are kept in the test's tmp dir (before.png, after.png)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.proto import load
from tests.integration.conftest import http_json, wait_ready
from tests.status.browser import chromium
from tests.support import ROOT, Proc, free_port, wait_for_port

pytestmark = pytest.mark.integration

pb2, pb2_grpc = load()


@dataclass
class Site:
    gateway: Proc
    backends: list[tuple[Proc, int, int]]  # (process, http port, grpc port)
    http: int
    grpc: int
    admin: int

    @property
    def status_url(self) -> str:
        return f"http://127.0.0.1:{self.admin}/status?refresh=1"


POLICY = """\
version: 1
listeners:
  http: {{host: 127.0.0.1, port: {http}}}
  grpc: {{host: 127.0.0.1, port: {grpc}}}
  admin: {{host: 127.0.0.1, port: {admin}}}
timeouts: {{connect_s: 1, first_byte_s: 5, drain_s: 5}}
backends:
  - name: sim-http
    protocol: http
    endpoints: [{{address: "127.0.0.1:{a_http}"}}, {{address: "127.0.0.1:{b_http}"}}]
  - name: sim-grpc
    protocol: grpc
    endpoints: [{{address: "127.0.0.1:{a_grpc}"}}, {{address: "127.0.0.1:{b_grpc}"}}]
    unary_methods: [/sluice.inference.v1.Inference/Infer]
routes:
  - name: grpc
    match: {{protocol: grpc}}
    backend: sim-grpc
  - name: openai
    match: {{protocol: http, path_prefix: /v1/}}
    backend: sim-http
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    tmp = tmp_path_factory.mktemp("status")
    backends: list[tuple[Proc, int, int]] = []
    gw = None
    try:
        for name in ("a", "b"):
            h, g = free_port(), free_port()
            args = ["mock-backend", "--http", f"127.0.0.1:{h}", "--grpc", f"127.0.0.1:{g}"]
            args.append("--no-admin")  # two of them: the default admin port would be taken
            backends.append((Proc(args, tmp / f"backend-{name}.log"), h, g))
        ports = {"http": free_port(), "grpc": free_port(), "admin": free_port()}
        (_, a_http, a_grpc), (_, b_http, b_grpc) = backends
        policy = tmp / "policy.yaml"
        policy.write_text(
            POLICY.format(**ports, a_http=a_http, a_grpc=a_grpc, b_http=b_http, b_grpc=b_grpc)
        )
        for _, h, g in backends:
            wait_for_port(h)
            wait_for_port(g)
        gw = Proc(["serve", "--policy", str(policy)], tmp / "gateway.log")
        wait_ready(ports["admin"], gw)
        yield Site(gw, backends, ports["http"], ports["grpc"], ports["admin"])
    finally:
        if gw is not None:
            assert gw.stop() == 0, gw.output()
        for p, _, _ in backends:
            p.stop()


def traffic(site: Site, n: int = 6) -> tuple[int, int]:
    """n chat completions and n gRPC calls through the gateway; returns how many failed."""
    body = json.dumps({"model": "any", "messages": [{"role": "user", "content": "Hello"}]})
    http_failed = grpc_failed = 0
    for _ in range(n):
        req = urllib.request.Request(
            f"http://127.0.0.1:{site.http}/v1/chat/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                r.read()
        except urllib.error.HTTPError as e:
            e.close()
            http_failed += 1
    with grpc.insecure_channel(f"127.0.0.1:{site.grpc}") as ch:
        stub = pb2_grpc.InferenceStub(ch)
        for _ in range(n):
            try:
                stub.Infer(pb2.InferRequest(model="any", prompt="hi"), timeout=10)
            except grpc.RpcError:
                grpc_failed += 1
    return http_failed, grpc_failed


def members(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["address"]: m for b in state["backends"]["backends"] for m in b["members"]}


def test_page_shows_colour_and_every_member_then_follows_a_killed_backend(
    site: Site, tmp_path: Path
) -> None:
    assert traffic(site) == (0, 0)
    addresses = [f"127.0.0.1:{p}" for _, h, g in site.backends for p in (h, g)]
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1200, "height": 1000})
        t0 = time.monotonic()
        page.goto(site.status_url)
        page.wait_for_selector("#banner[data-colour=green]", timeout=15_000)
        load_s = time.monotonic() - t0
        text = page.inner_text("body")
        assert page.inner_text("#colour") == "GREEN"
        for name in ("sim-http", "sim-grpc"):
            assert page.locator(f'h3[data-backend="{name}"]').count() == 1
        for addr in addresses:
            assert addr in text, addr
        assert "{'admin'" not in text  # listener ports as words, not a Python dict repr
        page.screenshot(path=str(tmp_path / "before.png"), full_page=True)

        b_proc, b_http, b_grpc = site.backends[1]
        b_proc.popen.kill()  # the backend dies; the page is not reloaded
        b_proc.popen.wait(10)
        # Each request draws its member at random (power of two choices over two idle members):
        # 20 of them reach the dead one with all but a 2^-20 chance (6 left it out 1 in 64).
        http_failed, grpc_failed = traffic(site, 20)
        assert http_failed > 0 and grpc_failed > 0, (http_failed, grpc_failed)

        # The page refreshes itself (every 1 s here) and turns the gateway colour.
        page.wait_for_selector("#banner:not([data-colour=green])", timeout=15_000)
        row = page.locator("tr", has_text=f"127.0.0.1:{b_grpc}")
        row.locator("text=TRANSIENT_FAILURE").wait_for(timeout=15_000)
        assert "red" in (row.get_attribute("class") or "")
        reasons = page.inner_text("#reasons")
        assert "sim-grpc: 1 of 2 members down" in reasons
        assert "sim-http" in reasons and "upstream errors" in reasons
        page.screenshot(path=str(tmp_path / "after.png"), full_page=True)
        page.set_viewport_size({"width": 960, "height": 560})  # the README's picture
        page.screenshot(path=str(tmp_path / "readme.png"))
    print(f"status page first render {load_s * 1000:.0f} ms; screenshots in {tmp_path}")

    state = http_json(f"http://127.0.0.1:{site.admin}/admin/state")
    assert state["colour"] == "yellow"
    assert members(state)[f"127.0.0.1:{b_grpc}"]["colour"] == "red"
    assert state["backends"]["backends"][0]["colour"] == "yellow"  # worst first


def test_terminal_prints_the_same_state(site: Site) -> None:
    admin = f"http://127.0.0.1:{site.admin}"
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "status", "--admin", admin],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    state = http_json(f"{admin}/admin/state")
    assert f" {state['colour'].upper()} " in out.stdout.splitlines()[0]
    for addr in members(state):
        assert addr in out.stdout
    assert f"http=127.0.0.1:{site.http}" in out.stdout
    raw = subprocess.run(
        [sys.executable, "-m", "gateway", "status", "--admin", admin, "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert json.loads(raw.stdout)["policy"]["version"] == state["policy"]["version"]
    gone = subprocess.run(
        [sys.executable, "-m", "gateway", "status", "--admin", f"http://127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert gone.returncode == 1 and "no answer from" in gone.stderr
