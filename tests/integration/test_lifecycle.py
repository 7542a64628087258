"""Hot reload and graceful drain, on a real gateway process."""

from __future__ import annotations

import asyncio
import signal
import urllib.request
from pathlib import Path

import aiohttp
import grpc
import pytest

from gateway.proto import load
from tests.integration.conftest import Backend, http_json, policy_yaml, readiness, start_gateway
from tests.support import metric_total, until

pytestmark = pytest.mark.integration

pb2, pb2_grpc = load()


async def _wait_version_change(admin: str, old: str, timeout: float = 5.0) -> dict:  # type: ignore[type-arg]
    return await until(  # type: ignore[no-any-return]
        lambda: http_json(f"{admin}/admin/policy")["status"],
        timeout,
        ok=lambda st: st["version"] != old or not st["last_reload"]["ok"],
        interval=0.1,
        what=f"a reload from version {old} (or a failed one)",
    )


def scrape(admin: str) -> str:
    with urllib.request.urlopen(f"{admin}/metrics", timeout=5) as r:
        return str(r.read().decode())


async def test_hot_reload_good_then_broken_file(backend: Backend, tmp_path: Path) -> None:
    gw = start_gateway(backend, tmp_path)
    try:
        v1 = http_json(f"{gw.admin}/admin/policy")["status"]["version"]
        # A good edit, picked up by the file watcher: the HTTP route gets a new name.
        gw.policy.write_text(
            policy_yaml(backend, gw.http_port, gw.grpc_port, gw.admin_port, http_route_name="v2")
        )
        st = await _wait_version_change(gw.admin, v1)
        assert st["last_reload"]["ok"] and st["version"] != v1
        v2 = st["version"]
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{gw.http}/v1/models") as r:
                assert r.status == 200
            # A broken edit: the old policy keeps serving, the error names the line.
            gw.policy.write_text(
                gw.policy.read_text().replace("protocol: grpc\n", "protocol: [\n", 1)
            )
            st = await _wait_version_change(gw.admin, v2)
            assert not st["last_reload"]["ok"] and st["version"] == v2
            assert any(f"{gw.policy}:" in e for e in st["last_reload"]["errors"]), st
            async with s.get(f"{gw.http}/v1/models") as r:
                assert r.status == 200
            # The explicit reload endpoint reports the same rejection with 422.
            async with s.post(f"{gw.admin}/admin/policy/reload") as r:
                assert r.status == 422
            async with s.get(f"{gw.admin}/metrics") as r:
                text = await r.text()
            assert 'sluice_policy_reloads_total{result="error"}' in text
            assert "sluice_policy_last_reload_success 0.0" in text
    finally:
        assert gw.proc.stop() == 0


async def test_sighup_reloads(backend: Backend, tmp_path: Path) -> None:
    gw = start_gateway(backend, tmp_path)
    try:
        v1 = http_json(f"{gw.admin}/admin/policy")["status"]["version"]
        text = policy_yaml(
            backend, gw.http_port, gw.grpc_port, gw.admin_port, http_route_name="hup"
        )
        gw.policy.write_text(text)
        gw.proc.popen.send_signal(signal.SIGHUP)
        st = await _wait_version_change(gw.admin, v1)
        assert st["version"] != v1 and st["last_reload"]["ok"]
    finally:
        assert gw.proc.stop() == 0


@pytest.mark.parametrize("engine", ["aiohttp", "native"])
async def test_sigterm_drains_in_flight_streams(
    backend: Backend, tmp_path: Path, engine: str
) -> None:
    gw = start_gateway(backend, tmp_path, engine=engine)
    tokens = 100  # 100 × 20 ms ≈ 2 s per stream, well inside drain_s = 10
    backend.knobs(completion_tokens=tokens)
    body = {"model": "m", "stream": True, "max_tokens": tokens, "prompt": "x"}
    streaming: set[int] = set()  # the streams that have had a token

    async def http_stream(s: aiohttp.ClientSession, i: int) -> int:
        async with s.post(f"{gw.http}/v1/completions", json=body) as r:
            assert r.status == 200
            lines = []
            async for line in r.content:
                if line.startswith(b"data: "):
                    streaming.add(i)
                    lines.append(line.strip())
            assert lines[-1] == b"data: [DONE]"  # the stream ended normally, not cut
            return sum(1 for line in lines if b'"finish_reason":null' in line)

    async def grpc_stream(stub: object, i: int) -> int:
        call = stub.Generate(pb2.InferRequest(prompt="x", max_tokens=tokens), timeout=20)  # type: ignore[attr-defined]
        n = 0
        async for _ in call:
            streaming.add(i)
            n += 1
        return n

    async with (
        aiohttp.ClientSession() as s,
        grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as ch,
    ):
        stub = pb2_grpc.InferenceStub(ch)
        tasks = [asyncio.ensure_future(http_stream(s, i)) for i in range(3)]
        tasks += [asyncio.ensure_future(grpc_stream(stub, i)) for i in range(3, 6)]
        await until(lambda: len(streaming), ok=lambda n: n == 6, what="all six streams under way")
        gw.proc.popen.send_signal(signal.SIGTERM)
        # Not ready any more, while the streams go on.
        _, ready = await until(lambda: readiness(gw.admin_port), ok=lambda r: r[0] == 503,
                               what="/readyz answering 503 after SIGTERM")  # fmt: skip
        assert ready["draining"] and ready["in_flight"] == 6, ready
        assert not any(t.done() for t in tasks)
        counts = await asyncio.gather(*tasks)
    backend.knobs(completion_tokens=16)
    assert all(c == tokens for c in counts), counts
    assert gw.proc.popen.wait(15) == 0, gw.proc.output()
    gw.proc.stop()


async def test_bad_policy_at_boot_exits_1_with_position(backend: Backend, tmp_path: Path) -> None:
    from tests.support import Proc

    policy = tmp_path / "bad.yaml"
    policy.write_text("version: 1\nroutes:\n  - name: r\n    backend: nowhere\n")
    proc = Proc(["serve", "--policy", str(policy)], tmp_path / "out.log")
    assert proc.popen.wait(20) == 1
    out = proc.output()
    proc.stop()
    assert f"{policy}:3:" in out or f"{policy}:4:" in out, out


async def test_workers_share_the_ports_and_stop_cleanly(backend: Backend, tmp_path: Path) -> None:
    gw = start_gateway(backend, tmp_path, workers=2)
    try:
        children = Path(f"/proc/{gw.proc.popen.pid}/task/{gw.proc.popen.pid}/children")
        assert len(children.read_text().split()) == 2
        async with aiohttp.ClientSession() as s:
            for _ in range(20):
                async with s.get(f"{gw.http}/v1/models", headers={"Connection": "close"}) as r:
                    assert r.status == 200
        # Aggregated over both workers; each worker moves its request tallies into the shared
        # files every second (gateway.telemetry.tally), so a scrape may lag by that.
        served = await until(
            lambda: metric_total(scrape(gw.admin), "sluice_requests_total", code="200"),
            ok=lambda n: n >= 20,
            interval=0.2,
            what="the 20 answers counted across both workers",
        )
        assert served == 20
    finally:
        assert gw.proc.stop() == 0, gw.proc.output()
