"""`sluice serve --workers 2` on real processes: a worker killed with SIGKILL (as the OOM killer
would) is logged, replaced and counted; a crash loop backs off; SIGTERM ends everything with 0."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.conftest import Backend, Gateway, policy_yaml, start_gateway
from tests.support import Proc, free_port, wait_until

pytestmark = pytest.mark.integration


def children(pid: int) -> set[int]:
    return {int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


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


def metrics_dir(pid: int) -> Path:
    """The multiprocess metrics directory a worker writes to (from its environment)."""
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    (found,) = [e for e in env if e.startswith(b"PROMETHEUS_MULTIPROC_DIR=")]
    return Path(found.split(b"=", 1)[1].decode())


def requests_counted(gw: Gateway) -> float:
    """Every worker's requests, dead ones included, as a scrape sums them."""
    text = metrics(gw)
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("sluice_requests_total{")
    )


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
        wait_until(lambda: ready_pids(gw) >= first, 20, what="both workers ready", proc=gw.proc)
        victim, other = sorted(first)
        served = [get(gw) for _ in range(20)]
        assert served == [200] * 20
        before = wait_until(lambda: requests_counted(gw), 10, ok=lambda n: n >= 20,
                            what="the 20 requests counted", proc=gw.proc)  # fmt: skip
        files = metrics_dir(victim)
        assert {f.name for f in files.glob(f"*_{victim}.db")}, list(files.iterdir())
        os.kill(victim, signal.SIGKILL)
        logged = f"(pid {victim}) killed by SIGKILL"
        wait_until(lambda: logged in gw.proc.output(), 20, what=repr(logged), proc=gw.proc)
        wait_until(lambda: children(gw.proc.popen.pid) - first, 20, what="a new worker",
                   ok=lambda new: len(new) == 1, proc=gw.proc)  # fmt: skip
        (new,) = children(gw.proc.popen.pid) - first
        seen.add(new)
        wait_until(lambda: new in ready_pids(gw), 20, what="the new worker ready", proc=gw.proc)
        assert victim not in ready_pids(gw)  # a dead worker's gauges are gone
        # Its counters are folded into the dead workers' file: no file of its own, no total lost.
        assert not list(files.glob(f"*_{victim}.db")), list(files.iterdir())
        assert (files / "counter_dead.db").exists()
        assert requests_counted(gw) >= before
        # Only the new worker listens while the other one is replaced in turn: all served.
        os.kill(other, signal.SIGKILL)
        wait_until(lambda: not alive(other), 20, what="the second kill", proc=gw.proc)
        assert [get(gw) for _ in range(20)] == [200] * 20
        wait_until(lambda: children(gw.proc.popen.pid), 20, what="two workers again",
                   ok=lambda pids: len(pids) == 2, proc=gw.proc)  # fmt: skip
        seen |= children(gw.proc.popen.pid)
        wait_until(
            lambda: len(ready_pids(gw) - first) == 2,
            20,
            what="both new workers ready",
            proc=gw.proc,
        )
        wait_until(
            lambda: sample(metrics(gw), "sluice_worker_restarts_total", reason="signal"),
            20,
            ok=lambda n: n == 2,
            what="two restarts counted",
            proc=gw.proc,
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
        wait_until(lambda: ready_pids(gw) >= first, 20, what="both workers ready", proc=gw.proc)
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

        wait_until(backed_off, 20, what="four failed replacements", proc=gw.proc)
        assert delays[:4] == [0.2, 0.4, 0.8, 1.6], delays  # after 0.1 s for the SIGKILL
        elapsed = time.monotonic() - t0
        assert elapsed > 0.1 + 0.2 + 0.4 + 0.8  # waited, did not spin
        assert get(gw) == 200  # the other worker kept serving on the old policy
        gw.policy.write_text(good)
        wait_until(
            lambda: len(ready_pids(gw) - first) == 1, 30, what="a replacement ready", proc=gw.proc
        )
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
    wait_until(lambda: ready_pids(gw) >= workers, 20, what="both workers ready", proc=gw.proc)
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
