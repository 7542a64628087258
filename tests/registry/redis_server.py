"""A private redis-server for tests (never the machine's own on 6379): a real process on a free
port, no persistence, stopped and started again on demand (to test Redis going down)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tests.support import free_port, require, wait_for_port

REDIS_SERVER = "/usr/bin/redis-server"


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        require(Path(REDIS_SERVER).exists(), f"needs {REDIS_SERVER} (Debian package redis-server)")
        self.port = free_port()
        self.dir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir), "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_for_port(self.port, timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the port must really be free before a restart
            try:
                wait_for_port(self.port, timeout=0.05)
            except TimeoutError:
                return
            time.sleep(0.05)
