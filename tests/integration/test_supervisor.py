"""`sluice serve --workers 2` on real processes: a worker killed with SIGKILL (as the OOM killer
would) is logged, replaced and counted; a crash loop backs off; SIGTERM ends everything with 0."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.conftest import Backend, Gateway, policy_yaml, start_gateway
from tests.support import Proc, free_port

pytestmark = pytest.mark.integration


def children(pid: int) -> set[int]:
    return {int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def eventually(check: Callable[[], bool], what: str, gw: Gateway, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        assert gw.proc.popen.poll() is None, gw.proc.output()
        time.sleep(0.05)
    raise AssertionError(f"{what} not seen within {timeout} s:\n{gw.proc.output()[-4000:]}")


def metrics(gw: Gateway) -> str:
    with urllib.request.urlopen(f"{gw.admin}/metrics", timeout=5) as r:
        return str(r.read().decode())


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one series, 0 if absent."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series == f"{name}{{{want}}}" or (not want and series == name):
            return float(value)
    return 0.0


def ready_pids(gw: Gateway) -> set[int]:
    """Worker pids whose `sluice_ready` is 1 (the gauge keeps one series per process)."""
    found = re.findall(r'^sluice_ready\{pid="(\d+)"\} 1\.0$', metrics(gw), re.MULTILINE)
    return {int(p) for p in found}


def get(gw: Gateway, path: str = "/v1/models") -> int:
    req = urllib.request.Request(f"{gw.http}{path}", headers={"Connection": "close"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return int(r.status)


def stop(gw: Gateway, workers: set[int]) -> None:
    gw.proc.popen.send_signal(signal.SIGTERM)
    code = gw.proc.popen.wait(30)
    assert code == 0, gw.proc.output()
    assert "SIGTERM: draining 2 workers" in gw.proc.output()
    assert not [p for p in workers if alive(p)]


def test_a_killed_worker_is_logged_replaced_and_counted(backend: Backend, tmp_path: Path) -> None:
    gw = start_gateway(backend, tmp_path, workers=2)
    seen: set[int] = set()
    try:
        first = children(gw.proc.popen.pid)
        assert len(first) == 2
        seen |= first
        eventually(lambda: ready_pids(gw) >= first, "both workers ready", gw)
        victim, other = sorted(first)
        os.kill(victim, signal.SIGKILL)
        eventually(lambda: f"(pid {victim}) killed by SIGKILL" in gw.proc.output(), "log", gw)
        eventually(lambda: len(children(gw.proc.popen.pid) - first) == 1, "a new worker", gw)
        (new,) = children(gw.proc.popen.pid) - first
        seen.add(new)
        eventually(lambda: new in ready_pids(gw), "the new worker ready", gw)
        assert victim not in ready_pids(gw)  # a dead worker's gauges are gone
        # Only the new worker listens while the other one is replaced in turn: all served.
        os.kill(other, signal.SIGKILL)
        eventually(lambda: not alive(other), "the second kill", gw)
        assert [get(gw) for _ in range(20)] == [200] * 20
        eventually(lambda: len(children(gw.proc.popen.pid)) == 2, "two workers again", gw)
        seen |= children(gw.proc.popen.pid)
        eventually(lambda: len(ready_pids(gw) - first) == 2, "both new workers ready", gw)
        eventually(
            lambda: sample(metrics(gw), "sluice_worker_restarts_total", reason="signal") == 2,
            "two restarts counted",
            gw,
        )
        assert re.search(r"starting a new one in 0\.1 s", gw.proc.output())
    finally:
        if gw.proc.popen.poll() is None:
            stop(gw, seen)
        gw.proc.stop()


def test_a_crash_loop_backs_off_and_recovers(backend: Backend, tmp_path: Path) -> None:
    gw = start_gateway(backend, tmp_path, workers=2)
    seen: set[int] = set()
    good = gw.policy.read_text()
    try:
        first = children(gw.proc.popen.pid)
        seen |= first
        eventually(lambda: ready_pids(gw) >= first, "both workers ready", gw)
        gw.policy.write_text("listeners: [not, a, mapping\n")  # every new worker exits 1
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        delays: list[float] = []
        pattern = re.compile(
            r"exited with status 1 after [\d.]+ s up; starting a new one in ([\d.]+) s"
        )

        def backed_off() -> bool:
            delays[:] = [float(d) for d in pattern.findall(gw.proc.output())]
            return len(delays) >= 4

        eventually(backed_off, "four failed replacements", gw)
        assert delays[:4] == [0.2, 0.4, 0.8, 1.6], delays  # after 0.1 s for the SIGKILL
        elapsed = time.monotonic() - t0
        assert elapsed > 0.1 + 0.2 + 0.4 + 0.8  # waited, did not spin
        assert get(gw) == 200  # the other worker kept serving on the old policy
        gw.policy.write_text(good)
        eventually(lambda: len(ready_pids(gw) - first) == 1, "a replacement ready", gw, 30)
        seen |= children(gw.proc.popen.pid)
        text = metrics(gw)
        assert sample(text, "sluice_worker_restarts_total", reason="signal") == 1
        assert sample(text, "sluice_worker_restarts_total", reason="exit") >= 4
    finally:
        gw.policy.write_text(good)
        if gw.proc.popen.poll() is None:
            stop(gw, seen)
        gw.proc.stop()


def test_a_failed_start_ends_the_supervisor(backend: Backend, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        http = taken.getsockname()[1]
        policy = tmp_path / "policy.yaml"
        text = policy_yaml(backend, free_port(), free_port(), free_port())
        policy.write_text(re.sub(r"port: \d+, engine", f"port: {http}, engine", text, count=1))
        proc = Proc(["serve", "--policy", str(policy), "--workers", "2"], tmp_path / "gw.log")
        try:
            code = proc.popen.wait(30)
        finally:
            proc.stop()
    output = proc.log_path.read_text()
    assert code == 1, output
    assert "exited with status 1 at start" in output
    assert "a worker could not start: draining 2 workers" in output
    assert "starting a new one" not in output


def test_no_worker_is_started_during_the_drain(backend: Backend, tmp_path: Path) -> None:
    gw = start_gateway(backend, tmp_path, workers=2)
    workers = children(gw.proc.popen.pid)
    eventually(lambda: ready_pids(gw) >= workers, "both workers ready", gw)
    gw.proc.popen.send_signal(signal.SIGTERM)
    os.kill(min(workers), signal.SIGKILL)  # dies while the others drain
    try:
        code = gw.proc.popen.wait(30)
    finally:
        gw.proc.stop()
    output = gw.proc.log_path.read_text()
    assert "starting a new one" not in output and "started again" not in output, output
    assert f"(pid {min(workers)}) killed by SIGKILL while draining" in output, output
    assert code == 1, output  # a worker that did not drain cleanly is no clean stop
    assert not [p for p in workers if alive(p)]
