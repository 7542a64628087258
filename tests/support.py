"""Shared test helpers: strict prerequisites, free ports, real processes."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import pytest

from gateway.bench.procs import free_port as free_port  # one port policy for tests and bench

ROOT = Path(__file__).resolve().parent.parent
STRICT = os.environ.get("SLUICE_STRICT") == "1"


def metric_total(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` in a Prometheus exposition `text` whose labels include
    `labels` (0 when there is none)."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(
            dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or "")).get(k) == v
            for k, v in labels.items()
        ):
            total += float(m.group(2))
    return total


def require(condition: bool, reason: str) -> None:
    """Skip when a prerequisite is missing; under SLUICE_STRICT=1 (CI) fail instead."""
    if condition:
        return
    if STRICT:
        pytest.fail(f"prerequisite missing (SLUICE_STRICT=1): {reason}")
    pytest.skip(reason)


def require_root() -> None:
    require(os.geteuid() == 0, "needs root")


def require_binary(name: str) -> str:
    path = shutil.which(name) or (
        f"/usr/sbin/{name}" if Path(f"/usr/sbin/{name}").exists() else None
    )
    require(path is not None, f"needs the {name} binary")
    assert path is not None
    return path


def wait_for_port(port: int, host: str = "127.0.0.1", timeout: float = 15.0) -> None:
    """Until something listens on host:port. A connection that met itself (TCP simultaneous
    open: the kernel picked `port` as its source port) is not a listener."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2) as s:
                if s.getsockname() != s.getpeername():
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout}s")


class Proc:
    """A real child process (`python -m gateway ...`) with its output captured to a file.

    Every one started is listed in `Proc.live` until stopped, so a test that fails before it
    stops its processes does not leave them running (tests/conftest.py stops them)."""

    live: ClassVar[list[Proc]] = []

    def __init__(self, args: Sequence[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log
        Proc.live.append(self)
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "gateway", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=full_env,
        )

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 10.0) -> int:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._log.close()
        if self in Proc.live:
            Proc.live.remove(self)
        return self.popen.returncode
