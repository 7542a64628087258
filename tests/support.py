"""Shared test helpers: strict prerequisites, free ports, real processes, waiting for an event."""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, NoReturn, TypeVar

import pytest

from gateway.bench.procs import free_port as free_port  # one port policy for tests and bench

ROOT = Path(__file__).resolve().parent.parent
STRICT = os.environ.get("SLUICE_STRICT") == "1"
T = TypeVar("T")


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


def wait_until(check: Callable[[], T], timeout: float = 10.0, **options: Any) -> T:
    """Poll `check()` until its value is true (or, given `ok`, until `ok(value)` is) and return
    that value; the options are `Waiting`'s. In a coroutine, `await until(...)` instead."""
    waiting: Waiting[T] = Waiting(check, timeout, **options)
    return waiting.wait()


async def until(check: Callable[[], T], timeout: float = 10.0, **options: Any) -> T:
    """`wait_until` for coroutines: it sleeps with `asyncio.sleep`, so the loop runs meanwhile.
    `check` runs on the loop: a quick blocking call (urllib to another process) is fine; one
    that needs this loop to make progress must not block."""
    waiting: Waiting[T] = Waiting(check, timeout, **options)
    return await waiting.wait_async()


class Waiting(Generic[T]):
    """One wait for an event: polls `check()` every `interval` s until its value is true (or,
    given `ok`, until `ok(value)` is). Give `check` the observation and `ok` the condition
    (`wait_until(lambda: stats()["in_flight"], ok=lambda n: n >= 6)`) and a failure shows the
    last observation, not only `False`.

    Raises AssertionError after `timeout` s, or as soon as `proc` (when given) has exited, saying
    `what` was awaited (by default the check's source), the last value seen and `proc`'s log
    tail. Exceptions of the `ignore` types count as "not yet" (a server still starting) and are
    shown after the last value; any other propagates at once."""

    def __init__(
        self,
        check: Callable[[], T],
        timeout: float = 10.0,
        *,
        ok: Callable[[T], object] | None = None,
        interval: float = 0.05,
        what: str = "",
        proc: Proc | None = None,
        ignore: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.check = check
        self.ok = ok
        self.timeout = timeout
        self.interval = interval
        self.what = what or describe(check)
        self.proc = proc
        self.ignore = ignore
        self.value: T
        self.last: object = None
        self.seen = False  # `check` has returned a value (`last`) at least once
        self.error: BaseException | None = None  # an ignored one, raised after `last`
        self.deadline = time.monotonic() + timeout

    def poll(self) -> bool:
        """True once the event has come (its value in `value`); False to poll again. Raises
        AssertionError when the time is up or the watched process has exited."""
        try:
            value = self.check()
        except self.ignore as e:
            self.error = e
        else:
            self.last, self.seen, self.error = value, True, None
            if self.ok(value) if self.ok is not None else value:
                self.value = value
                return True
        if self.proc is not None and self.proc.popen.poll() is not None:
            self.fail(f"the process exited ({self.proc.popen.returncode})")
        if time.monotonic() >= self.deadline:
            self.fail(f"not within {self.timeout:g} s")
        return False

    def wait(self) -> T:
        while not self.poll():
            time.sleep(self.interval)
        return self.value

    async def wait_async(self) -> T:
        while not self.poll():
            await asyncio.sleep(self.interval)
        return self.value

    def fail(self, why: str) -> NoReturn:
        last = repr(self.last) if self.seen else "nothing"
        if len(last) > 600:
            last = last[:600] + "..."
        message = f"waited for {self.what}: {why}; last seen: {last}"
        if self.error is not None:
            message += f", then {self.error!r}"
        if self.proc is not None:
            message += f"\n--- {self.proc.log_path} (tail) ---\n{self.proc.output()[-4000:]}"
        raise AssertionError(message)


def describe(check: Callable[[], object]) -> str:
    """The source text of `check` (a lambda's line), to say what a wait waited for."""
    try:
        text = " ".join(inspect.getsource(check).split()).rstrip(",")
    except (OSError, TypeError):
        text = getattr(check, "__qualname__", repr(check))
    return text if len(text) <= 200 else text[:200] + "..."


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
