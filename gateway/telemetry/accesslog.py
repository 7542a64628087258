"""(compiled) The access log sink: JSON lines to stderr, buffered and written in batches.

One `write` per request through the `logging` module costs a LogRecord, a handler lock and a
syscall (~15 µs here); this sink appends the line to a bounded buffer and writes it out at most
every `FLUSH_INTERVAL_S` or when `FLUSH_BYTES` are pending. When the buffer is full (stderr
stalled), new lines are dropped and counted, so a slow log pipe cannot grow memory or stall
requests. The server flushes it on shutdown.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from typing import Final

from gateway.telemetry import metrics

FLUSH_INTERVAL_S: Final = 0.1
FLUSH_BYTES: int = 64 * 1024  # not Final: tests lower it
MAX_PENDING_BYTES: int = 4 * 1024 * 1024  # not Final: tests lower it


def _write_stderr(data: bytes) -> None:
    fd = sys.stderr.fileno()
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class AccessLogSink:
    __slots__ = ("_lines", "_pending", "_timer", "_write")

    def __init__(self, write: Callable[[bytes], None] = _write_stderr) -> None:
        self._lines: list[str] = []
        self._pending = 0
        self._timer: asyncio.TimerHandle | None = None
        self._write = write

    def emit(self, line: str) -> None:
        if self._pending + len(line) > MAX_PENDING_BYTES:
            metrics.ACCESS_LOG_DROPPED.inc()
            return
        self._lines.append(line)
        self._pending += len(line) + 1
        if self._pending >= FLUSH_BYTES:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a CLI or a sync test): write at once
                self.flush()
                return
            self._timer = loop.call_later(FLUSH_INTERVAL_S, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._lines:
            return
        data = ("\n".join(self._lines) + "\n").encode()
        self._lines.clear()
        self._pending = 0
        try:
            self._write(data)
        except OSError:  # stderr closed or broken: the log is lost, the request is not
            metrics.ACCESS_LOG_DROPPED.inc()


SINK = AccessLogSink()
