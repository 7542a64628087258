"""Helpers for the backends tests: several simulated backends as real processes, a gateway
over a policy text, a load generator that records every answer, and /admin/backends."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tests.integration.conftest import http_json, wait_ready
from tests.support import Proc, free_port, until, wait_for_port

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@dataclass
class Sim:
    """One simulated backend process (HTTP only unless asked); its admin API (knobs, stats) on
    a loopback listener of its own."""

    proc: Proc
    port: int
    admin_port: int
    grpc_port: int | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def knobs(self, **changes: Any) -> Any:
        return http_json(f"http://127.0.0.1:{self.admin_port}/admin/knobs", "POST", changes)

    def stats(self) -> Any:
        return http_json(f"http://127.0.0.1:{self.admin_port}/admin/stats")

    def served(self) -> int:
        return int(sum(self.stats()["requests"].values()))

    def reset(self) -> None:
        http_json(f"http://127.0.0.1:{self.admin_port}/admin/reset", "POST", {})

    def kill(self) -> None:
        self.proc.popen.send_signal(signal.SIGKILL)
        self.proc.popen.wait(5)
        self.proc.stop()  # closes its log


Spawn = Callable[..., list[Sim]]


def start_sims(tmp: Path, n: int, *args: str, grpc: bool = False) -> list[Sim]:
    """`n` simulated backends started side by side. One that cannot bind its port (taken by
    another process between `free_port` and its bind) is started again on another."""

    def launch(i: int) -> Sim:
        port, admin = free_port(), free_port()
        gport = free_port() if grpc else None
        cmd = ["mock-backend", "--http", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}"]
        cmd += ["--grpc", f"127.0.0.1:{gport}"] if grpc else ["--no-grpc"]
        return Sim(Proc([*cmd, *args], tmp / f"sim{i}-{port}.log"), port, admin, gport)

    sims = [launch(i) for i in range(n)]
    for i, s in enumerate(sims):
        for _ in range(3):
            try:
                _wait_listening(s)
                break
            except RuntimeError:
                s.proc.stop()
                s = sims[i] = launch(i)
        else:
            raise RuntimeError(f"simulated backend would not start:\n{s.proc.output()}")
    return sims


def _wait_listening(s: Sim, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    ports = [p for p in (s.port, s.admin_port, s.grpc_port) if p]
    while time.monotonic() < deadline:
        if s.proc.popen.poll() is not None:
            raise RuntimeError("exited")
        try:
            for p in ports:
                wait_for_port(p, timeout=0.2)
        except TimeoutError:
            continue
        if f"mock backend listening: http port {s.port}," in s.proc.output():
            return  # its own word that it bound them all, not only that something answers
        time.sleep(0.05)
    raise TimeoutError(f"simulated backend not listening after {timeout}s:\n{s.proc.output()}")


@dataclass
class Gw:
    proc: Proc
    policy: Path
    port: int
    admin_port: int
    grpc_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def backends(self) -> Any:
        return http_json(f"http://127.0.0.1:{self.admin_port}/admin/backends")

    def member(self, backend: str, address: str) -> Any:
        for m in self.backends()["backends"][backend]["members"]:
            if m["address"] == address:
                return m
        return None

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.admin_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            return str(r.read().decode())

    def version(self) -> str:
        return str(
            http_json(f"http://127.0.0.1:{self.admin_port}/admin/policy")["status"]["version"]
        )

    def stop(self) -> str:
        code = self.proc.stop()
        out = self.proc.output()
        assert code == 0, out
        return out


def policy_text(
    port: int, admin: int, grpc: int, body: str, engine: str = "native", grpc_engine: str = "h2"
) -> str:
    return f"""\
version: 1
listeners:
  http: {{host: 127.0.0.1, port: {port}, engine: {engine}}}
  grpc: {{host: 127.0.0.1, port: {grpc}, engine: {grpc_engine}}}
  admin: {{host: 127.0.0.1, port: {admin}}}
access_log: {{enabled: false}}
{body}"""


def start_gateway(tmp: Path, body: str, engine: str = "native", grpc_engine: str = "h2") -> Gw:
    port, admin, grpc = free_port(), free_port(), free_port()
    path = tmp / "policy.yaml"
    path.write_text(policy_text(port, admin, grpc, body, engine, grpc_engine))
    proc = Proc(["serve", "--policy", str(path)], tmp / "gateway.log",
                env={"SLUICE_WATCH_INTERVAL": "0.1"})  # fmt: skip
    wait_ready(admin, proc)
    return Gw(proc, path, port, admin, grpc)


def rewrite(gw: Gw, body: str, engine: str = "native") -> None:
    """Replace the policy (the gateway's watcher reloads it)."""
    tmp = gw.policy.with_suffix(".tmp")
    tmp.write_text(policy_text(gw.port, gw.admin_port, gw.grpc_port, body, engine))
    tmp.replace(gw.policy)


@dataclass
class Answer:
    start: float
    end: float
    status: int
    error: str = ""


@dataclass
class Load:
    """Closed-loop load: `workers` clients, each sending the next request when one ends."""

    url: str
    workers: int = 8
    body: dict[str, Any] = field(default_factory=lambda: dict(CHAT))
    headers: dict[str, str] = field(default_factory=dict)
    answers: list[Answer] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def _worker(self, session: aiohttp.ClientSession) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                async with session.post(
                    self.url + "/v1/chat/completions", json=self.body, headers=self.headers
                ) as r:
                    raw = await r.read()
                    err = ""
                    if r.status != 200:
                        try:
                            err = json.loads(raw)["error"]["type"]
                        except (ValueError, KeyError, TypeError):
                            err = raw[:80].decode(errors="replace")
                    self.answers.append(Answer(t0, time.monotonic(), r.status, err))
            except (TimeoutError, aiohttp.ClientError) as e:
                self.answers.append(Answer(t0, time.monotonic(), 0, type(e).__name__))

    async def __aenter__(self) -> Load:
        timeout = aiohttp.ClientTimeout(total=20)
        self._session = aiohttp.ClientSession(timeout=timeout)
        self._tasks = [
            asyncio.create_task(self._worker(self._session)) for _ in range(self.workers)
        ]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._session.close()

    def failures(self, since: float = 0.0) -> list[Answer]:
        return [a for a in self.answers if a.status != 200 and a.end >= since]

    def ok(self, since: float = 0.0) -> int:
        return sum(1 for a in self.answers if a.status == 200 and a.start >= since)

    async def answered(self, n: int, timeout: float = 30.0) -> float:
        """Until `n` requests sent from now on are answered 200; returns when "now" was."""
        since = time.monotonic()
        await until(lambda: self.ok(since=since), timeout, ok=lambda k: k >= n,
                    what=f"{n} answers 200 (failures: {self.failures(since)[:3]})")  # fmt: skip
        return since
