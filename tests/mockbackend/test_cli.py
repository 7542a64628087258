"""`sluice mock-backend` as a real process: it answers on both ports and exits 0 on SIGTERM."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from gateway.proto import load
from tests.support import Proc, free_port, wait_for_port

pb2, pb2_grpc = load()


@pytest.mark.integration
def test_cli_serves_then_exits_cleanly(tmp_path: Path) -> None:
    http_port, grpc_port, admin_port = free_port(), free_port(), free_port()
    args = [
        "mock-backend",
        f"--http=127.0.0.1:{http_port}",
        f"--grpc=127.0.0.1:{grpc_port}",
        f"--admin=127.0.0.1:{admin_port}",
        "--ttft-ms=0",
        "--token-delay-ms=0",
        "--completion-tokens=3",
    ]
    proc = Proc(args, log=tmp_path / "mock.log")
    try:
        wait_for_port(http_port)
        wait_for_port(grpc_port)
        request = urllib.request.Request(
            f"http://127.0.0.1:{http_port}/v1/completions",
            data=json.dumps({"model": "m", "prompt": "abcd"}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as resp:
            assert json.load(resp)["usage"]["total_tokens"] == 4
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            reply = pb2_grpc.InferenceStub(channel).Infer(pb2.InferRequest(prompt="x"), timeout=5)
        assert reply.usage.completion_tokens == 3
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/admin/stats", timeout=5) as r:
            assert json.load(r)["completed"] == 2
    finally:
        code = proc.stop()
    output = proc.log_path.read_text()  # stop() closed the log: read the file
    assert code == 0, output
    assert f"http port {http_port}, grpc port {grpc_port}, admin port {admin_port}" in output


@pytest.mark.integration
def test_cli_port_in_use_fails(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["mock-backend", f"--http=127.0.0.1:{port}", "--no-grpc", "--no-admin"]
        proc = Proc(args, tmp_path / "m.log")
        code = proc.popen.wait(15)
        proc.stop()
    assert code == 1, proc.log_path.read_text()


@pytest.mark.integration
def test_cli_refuses_a_public_admin_listener(tmp_path: Path) -> None:
    args = ["mock-backend", "--http=127.0.0.1:0", "--no-grpc", "--admin=0.0.0.0:0"]
    proc = Proc(args, tmp_path / "m.log")
    code = proc.popen.wait(15)
    proc.stop()
    output = proc.log_path.read_text()
    assert code == 2, output
    assert "admin listener must be on loopback" in output


ADMIN_LINE = re.compile(r"mock backend admin API: http://127\.0\.0\.1:(\d+)/admin/knobs")


def logged_admin_port(proc: Proc, timeout: float = 15.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = ADMIN_LINE.search(proc.output())
        if found:
            return int(found.group(1))
        assert proc.popen.poll() is None, proc.output()
        time.sleep(0.05)
    raise AssertionError(f"no admin port logged: {proc.output()}")


@pytest.mark.integration
def test_two_backends_without_admin_run_at_once(tmp_path: Path) -> None:
    """Without `--admin` each backend picks a free loopback port and says which."""
    procs = [
        Proc(
            ["mock-backend", f"--http=127.0.0.1:{free_port()}", "--no-grpc"], tmp_path / f"{i}.log"
        )
        for i in range(2)
    ]
    try:
        ports = [logged_admin_port(p) for p in procs]
        assert ports[0] != ports[1]
        for port in ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/stats", timeout=5) as r:
                assert json.load(r)["completed"] == 0
        assert all(p.popen.poll() is None for p in procs)
    finally:
        codes = [p.stop() for p in procs]
    assert codes == [0, 0], [p.log_path.read_text() for p in procs]
