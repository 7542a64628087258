"""`sluice serve --workers N`: N serving processes on the same ports (SO_REUSEPORT), kept at N.

A worker that dies without being asked to (the OOM killer, a crash, a stray signal) is logged
with how it ended and replaced after a back-off: 0.1 s, doubled for each replacement that dies
young (up within `STABLE_S`), at most `MAX_BACKOFF_S`, so a crash loop cannot spin; a worker that
stayed up `STABLE_S` starts the count again. The replacement counts itself in
`sluice_worker_restarts_total` (prometheus-client multiprocess mode: every worker's /metrics
shows it; the supervisor imports no metric, whose zero gauges would show up as a process).

TERM and INT are forwarded and drain every worker; none is replaced from then on, and one
still running `timeouts.drain_s` + 10 s later is killed. HUP is forwarded (each worker reloads
its policy). A worker of the first generation that exits with an
error before it settled means the gateway cannot start (a taken port, a bad policy): the others
are stopped and the supervisor exits with that status, as a single process would.

The simulated backend (if the policy enables it) runs once, in its own child, stopped after
every worker has drained. Metrics are aggregated across workers through the multiprocess
directory the supervisor creates and removes; a dead worker's gauges leave it with the worker.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.errors import PolicyError

log = logging.getLogger("sluice.supervisor")

FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0  # a worker up this long is healthy: the next death restarts at FIRST_BACKOFF_S
SETTLE_S = 10.0  # a first-generation worker that errors out sooner failed to start
KILL_GRACE_S = 10.0
POLL_S = 1.0  # the longest wait without a signal (a lost wake-up costs at most this)
REPLACES_ENV = "SLUICE_WORKER_REPLACES"  # set for a replacement: how its predecessor ended
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def next_backoff(previous_s: float, up_s: float) -> float:
    """The wait before replacing a worker that died after `up_s` seconds, given the wait before
    it started (0 for the first generation). Pure: the supervisor passes the times."""
    if up_s >= STABLE_S or previous_s <= 0:
        return FIRST_BACKOFF_S
    return min(MAX_BACKOFF_S, previous_s * 2)


def ended(code: int) -> str:
    """How a worker ended, for the log: `killed by SIGKILL` or `exited with status 1`."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def count_replacement() -> None:
    """In a worker: count it in `sluice_worker_restarts_total` if it replaces one that died."""
    reason = os.environ.get(REPLACES_ENV)
    if reason:
        from gateway.telemetry.metrics import WORKER_RESTARTS

        WORKER_RESTARTS.labels(reason).inc()


@dataclass
class Slot:
    """One of the N worker places: its current process and its back-off state."""

    index: int
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    generation: int = 0
    backoff_s: float = 0.0
    restart_at: float | None = None
    replaces: str = ""  # how the previous worker ended: "signal" or "exit"


@dataclass
class Supervisor:
    """Keeps `workers` copies of `command` running until TERM/INT, then drains them."""

    command: list[str]
    env: dict[str, str]
    workers: int
    metrics_dir: str
    kill_after_s: float  # a worker still running this long after TERM/INT is killed
    slots: list[Slot] = field(default_factory=list)
    stopping: bool = False
    kill_at: float | None = None
    stop_signal: int = signal.SIGTERM
    failed_start: int | None = None
    final_codes: list[int] = field(default_factory=list)

    def run(self) -> int:
        rfd, wfd = os.pipe()
        os.set_blocking(rfd, False)
        os.set_blocking(wfd, False)
        pending: deque[int] = deque()  # append and popleft are safe against a handler

        def note(signum: int, _frame: object) -> None:
            pending.append(signum)  # handled in the loop; the wake-up fd ends its wait

        previous = {s: signal.signal(s, note) for s in (*FORWARDED, signal.SIGCHLD)}
        old_fd = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
        try:
            self.slots = [Slot(i) for i in range(self.workers)]
            for slot in self.slots:
                self._start(slot)
            self._loop(pending, rfd)
        except BaseException:
            for slot in self.slots:  # never leave a worker behind
                if slot.proc is not None and slot.proc.poll() is None:
                    slot.proc.kill()
                    slot.proc.wait(KILL_GRACE_S)
            raise
        finally:
            signal.set_wakeup_fd(old_fd)
            for s, handler in previous.items():
                signal.signal(s, handler)
            os.close(rfd)
            os.close(wfd)
        if self.failed_start is not None:
            return self.failed_start
        return 0 if all(c == 0 for c in self.final_codes) else 1

    def _loop(self, pending: deque[int], rfd: int) -> None:
        while True:
            self._wait(rfd)
            while pending:
                self._on_signal(pending.popleft())
            self._reap()
            if self.stopping:
                if all(s.proc is None for s in self.slots):
                    return
                self._kill_late()
                continue
            self._start_due()

    def _wait(self, rfd: int) -> None:
        now = time.monotonic()
        due = [s.restart_at for s in self.slots if s.restart_at is not None]
        if self.kill_at is not None:
            due.append(self.kill_at)
        timeout = min([POLL_S, *(max(0.0, t - now) for t in due)])
        select.select([rfd], [], [], timeout)
        with contextlib.suppress(BlockingIOError):
            while os.read(rfd, 512):
                pass

    def _on_signal(self, signum: int) -> None:
        if signum == signal.SIGCHLD:
            return  # only a wake-up: _reap looks at every worker
        if signum in (signal.SIGTERM, signal.SIGINT) and not self.stopping:
            self._stop(signal.Signals(signum).name, signum)
            return
        self._forward(signum)

    def _stop(self, why: str, signum: int) -> None:
        """Drain every worker (`signum` forwarded) and start none from now on."""
        log.info("%s: draining %d workers", why, self.workers)
        self.stopping = True
        self.stop_signal = signum
        self.kill_at = time.monotonic() + self.kill_after_s
        for slot in self.slots:
            slot.restart_at = None
        self._forward(signum)

    def _forward(self, signum: int) -> None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.send_signal(signum)

    def _kill_late(self) -> None:
        if self.kill_at is None or time.monotonic() < self.kill_at:
            return
        self.kill_at = None
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                log.error(
                    "worker %d (pid %d) still running %.0f s after the stop: killing it",
                    slot.index, slot.proc.pid, self.kill_after_s,
                )  # fmt: skip
                slot.proc.kill()

    def _reap(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            if slot.proc is None or (code := slot.proc.poll()) is None:
                continue
            pid, up_s = slot.proc.pid, now - slot.started
            slot.proc = None
            self._forget_metrics(pid)
            if self.stopping:
                # A worker still starting when TERM came has no handler yet: TERM ends it.
                code = 0 if code == -self.stop_signal else code
                self.final_codes.append(code)
                if code != 0:
                    log.warning(
                        "worker %d (pid %d) %s while draining", slot.index, pid, ended(code)
                    )
                continue
            if slot.generation == 0 and code > 0 and up_s < SETTLE_S:
                log.error("worker %d (pid %d) %s at start", slot.index, pid, ended(code))
                self.failed_start = code
                self._stop("a worker could not start", signal.SIGTERM)
                continue
            slot.backoff_s = next_backoff(slot.backoff_s, up_s)
            slot.restart_at = now + slot.backoff_s
            slot.replaces = "signal" if code < 0 else "exit"
            log.error(
                "worker %d (pid %d) %s after %.1f s up; starting a new one in %.1f s",
                slot.index, pid, ended(code), up_s, slot.backoff_s,
            )  # fmt: skip

    def _start_due(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            if slot.restart_at is not None and slot.restart_at <= now:
                slot.restart_at = None
                slot.generation += 1
                self._start(slot)

    def _start(self, slot: Slot) -> None:
        env = {**self.env, "SLUICE_WORKER": str(slot.index)}
        if slot.replaces:
            env[REPLACES_ENV] = slot.replaces
        slot.proc = subprocess.Popen(self.command, env=env)
        slot.started = time.monotonic()
        if slot.generation:
            log.info("worker %d started again (pid %d)", slot.index, slot.proc.pid)

    def _forget_metrics(self, pid: int) -> None:
        # A dead worker's gauges are no longer true (its `sluice_ready` 1, its in-flight count):
        # drop them, as prometheus-client's mark_process_dead does for the live* modes only.
        # Its counters and histograms are totals that include its work: they are added into one
        # file per kind for all dead workers, so a worker that keeps crashing does not add files
        # that every scrape reads.
        for f in Path(self.metrics_dir).glob(f"gauge_*_{pid}.db"):
            f.unlink(missing_ok=True)
        for kind in ("counter", "histogram"):
            fold_metrics(Path(self.metrics_dir), kind, pid)


def fold_metrics(directory: Path, kind: str, pid: int) -> None:
    """Add a dead process's `kind` values into `<kind>_dead.db` and remove its file: a scrape
    sums the files of a kind, so the totals are unchanged."""
    from prometheus_client import mmap_dict

    mmaped: Any = mmap_dict.MmapedDict  # untyped upstream
    src = directory / f"{kind}_{pid}.db"
    if not src.exists():
        return
    into = mmaped(str(directory / f"{kind}_dead.db"))
    try:
        for key, value, timestamp, _ in mmaped.read_all_values_from_file(str(src)):
            have, _ts = into.read_value(key)
            into.write_value(key, have + value, timestamp)
    finally:
        into.close()
    src.unlink(missing_ok=True)


def run_workers(args: argparse.Namespace) -> int:
    """Run `args.workers` serving processes on the same ports under a `Supervisor`."""
    from gateway.policy.loader import load_policy

    try:
        policy = load_policy(args.policy)
    except PolicyError as e:
        for line in e.errors:
            print(line, file=sys.stderr)
        return 1
    metrics_dir = tempfile.mkdtemp(prefix="sluice-metrics-")
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": metrics_dir,
        "SLUICE_NO_MOCK": "1",
        "SLUICE_WORKERS": str(args.workers),  # memory rate limits give each worker 1/N
    }
    env.pop(REPLACES_ENV, None)
    mock: subprocess.Popen[bytes] | None = None
    m = policy.mock_backend
    if m.enabled:
        cmd = [sys.executable, "-m", "gateway", "mock-backend"]
        cmd += ["--http", m.http] if m.http else ["--no-http"]
        cmd += ["--grpc", m.grpc] if m.grpc else ["--no-grpc"]
        cmd += ["--admin", m.admin] if m.admin else ["--no-admin"]
        mock = subprocess.Popen(cmd, env=os.environ.copy())
    command = [sys.executable, "-m", "gateway", "serve", "--policy", str(args.policy)]
    command += ["--workers", "1", "--log-level", args.log_level]
    try:
        # Each worker drains for up to drain_s; the grace covers its start and its close.
        kill_after_s = policy.timeouts.drain_s + KILL_GRACE_S
        code = Supervisor(command, env, args.workers, metrics_dir, kill_after_s).run()
    finally:
        if mock is not None:  # the backend goes last, after every worker has drained
            mock.terminate()
            try:
                mock_code = mock.wait(KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                mock.kill()
                mock_code = mock.wait(KILL_GRACE_S)
        with contextlib.suppress(OSError):
            for f in Path(metrics_dir).iterdir():
                f.unlink()
            Path(metrics_dir).rmdir()
    if mock is not None and mock_code not in (0, -signal.SIGTERM):
        return code or 1
    return code
