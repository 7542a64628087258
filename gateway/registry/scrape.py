"""Scrapes of the members' model servers (`backends[].load.metrics`): one small loop per member
that reads the server's Prometheus page and leaves its figures on the member's shared state
(`Core.figures`, `Core.server`), where the pick and the admission queue read them.

Cheap on purpose, since it runs every 100 ms per member:
- one keep-alive HTTP/1.1 connection per member, on raw asyncio streams (no client library
  per request, no connection per scrape);
- the page is scanned for the few names wanted (`gateway.core.serverload.scan`), never parsed;
- each scrape has a deadline (`timeout_ms`) and a size bound (`max_bytes`): a slow or huge page
  fails it;
- members are staggered over the interval by a hash of their address, so 100 members at
  100 ms are one scrape per millisecond, not a burst of 100 every 100 ms.

A failed scrape is counted (`sluice_server_scrapes_total{result="error"}`) and shown in
`/admin/state`, and is not a failed health check: the figures age, and after 3 intervals the
pick falls back to this gateway's own counts. A metric the page does not have is named in
`/admin/state` and logged once (a renamed metric must not look like an idle server).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from gateway.core.balancer import hash_key
from gateway.core.serverload import Figures, Weights, fresh, full, scan, score, wanted
from gateway.telemetry import metrics

if TYPE_CHECKING:
    from gateway.policy.backends import ServerMetrics
    from gateway.registry.member import Core, Member, MemberBooks
    from gateway.services import Services
    from gateway.upstream.tls import ClientTls

log = logging.getLogger("sluice.backends")

MAX_HEAD = 16 * 1024  # status line and headers of the metrics page's answer


class ScrapeError(Exception):
    """One scrape failed (the text says why); the connection is dropped."""


class Conn:
    """One keep-alive HTTP/1.1 connection to a metrics page."""

    __slots__ = ("host", "port", "tls", "request", "reader", "writer")

    def __init__(self, host: str, port: int, path: str, tls: ClientTls | None = None) -> None:
        self.host, self.port, self.tls = host, port, tls
        hosthdr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.request = (f"GET {path} HTTP/1.1\r\nHost: {hosthdr}\r\nUser-Agent: sluice-scrape\r\n"
                        "Accept: text/plain\r\n\r\n").encode("latin-1")  # fmt: skip
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def get(self, limit: int) -> bytes:
        """The page's body (ScrapeError when not 200, larger than `limit`, or malformed). The
        caller bounds the time."""
        if self.writer is None or self.writer.is_closing():
            if self.tls is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            else:
                self.reader, self.writer = await asyncio.open_connection(
                    self.host, self.port, ssl=self.tls.context,
                    server_hostname=self.tls.server_hostname(self.host),
                )  # fmt: skip
        reader, writer = self.reader, self.writer
        assert reader is not None
        writer.write(self.request)
        head = await reader.readuntil(b"\r\n\r\n")
        if len(head) > MAX_HEAD:
            raise ScrapeError("answer head too large")
        status_line, _, rest = head.partition(b"\r\n")
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise ScrapeError("not an HTTP/1.1 answer")
        length = -1
        chunked = close = False
        for line in rest.split(b"\r\n"):
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value.strip())
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                close = b"close" in value.lower()
        if chunked:
            body = await _chunked(reader, limit)
        elif length >= 0:
            if length > limit:
                raise ScrapeError(f"page of {length} bytes is over max_bytes")
            body = await reader.readexactly(length)
        else:  # read to the end of the connection
            body = await reader.read(limit + 1)
            close = True
            if len(body) > limit:
                raise ScrapeError("page is over max_bytes")
        if close:
            self.close()
        if parts[1] != b"200":
            raise ScrapeError(f"status {parts[1].decode('latin-1')}")
        return body


async def _chunked(reader: asyncio.StreamReader, limit: int) -> bytes:
    out = bytearray()
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            await reader.readuntil(b"\r\n")  # no trailers expected: the empty line
            return bytes(out)
        if len(out) + size > limit:
            raise ScrapeError("page is over max_bytes")
        out += await reader.readexactly(size)
        await reader.readexactly(2)


class Record:
    """One member's scrape record, on its `Core` (what /admin/state shows)."""

    __slots__ = ("ok", "failed", "last_error", "missing", "full", "interval")

    def __init__(self, interval: float) -> None:
        self.ok = 0
        self.failed = 0
        self.last_error = ""
        self.missing: tuple[str, ...] = ()
        self.full = False
        self.interval = interval

    def snapshot_of(self, core: Core, now: float) -> dict[str, object]:
        f = core.figures
        out: dict[str, object] = {"scrapes_ok": self.ok, "scrapes_failed": self.failed,
                                  "full": self.full, "adds": round(core.server, 3)}  # fmt: skip
        if f is not None:
            out |= {"running": f.running, "waiting": f.waiting, "kv_cache": f.kv_cache,
                    "age_s": round(now - f.at, 3),
                    "stale": not fresh(f, now, self.interval)}  # fmt: skip
        if self.missing:
            out["missing_metrics"] = list(self.missing)
        if self.last_error:
            out["last_error"] = self.last_error
        return out


class Scraper:
    """One `load.metrics` section of one backend: the scrape loops of its members (started and
    stopped by `sync` as members come and go; `stop` ends them all)."""

    def __init__(
        self, services: Services, pool: MemberBooks, backend: str, cfg: ServerMetrics,
        max_in_flight: int | None,
    ) -> None:  # fmt: skip
        self.services = services
        self.pool = pool
        self.backend = backend
        self.cfg = cfg
        self.want = wanted(cfg.preset, cfg.names.model_dump())
        w = cfg.weights
        self.weights = Weights(w.running, w.waiting, w.kv_cache)
        self.interval = cfg.interval_ms / 1000
        self.timeout = cfg.timeout_ms / 1000
        self.max_in_flight = max_in_flight
        self.loops: dict[str, tuple[Core, asyncio.Task[None]]] = {}

    def sync(self, members: Iterable[Member]) -> None:
        """Scrape exactly these members (needs a running loop)."""
        seen = set()
        for m in members:
            seen.add(m.address)
            if m.address not in self.loops:
                host, port, tls = self._target(m)
                task = self.services.spawn(self._loop(m.core, host, port, tls),
                                           f"scrape:{self.backend}:{m.address}")  # fmt: skip
                self.loops[m.address] = (m.core, task)
        for address in [a for a in self.loops if a not in seen]:
            self._end(address)

    def _target(self, m: Member) -> tuple[str, int, ClientTls | None]:
        """Where a member's page is: `address`, `port` on its host (plain HTTP), or the member's
        own address (over the backend's TLS if it has it)."""
        if self.cfg.address is not None:
            host, _, port = self.cfg.address.rpartition(":")
            return host.strip("[]"), int(port), None
        ep = m.endpoint
        if self.cfg.port is not None:
            return ep.host, self.cfg.port, None
        return ep.host, ep.port, ep.tls

    def _end(self, address: str) -> None:
        core, task = self.loops.pop(address)
        task.cancel()
        core.scrape = None
        core.figures = None
        core.server = 0.0

    def stop(self) -> None:
        for address in list(self.loops):
            self._end(address)

    async def _loop(self, core: Core, host: str, port: int, tls: ClientTls | None) -> None:
        loop = asyncio.get_running_loop()
        conn = Conn(host, port, self.cfg.path, tls)
        rec = core.scrape = Record(self.interval)
        ok_c = metrics.SERVER_SCRAPES.labels(self.backend, "ok")
        err_c = metrics.SERVER_SCRAPES.labels(self.backend, "error")
        # Staggered: each member at its own offset within the interval (by its address).
        await asyncio.sleep((hash_key(f"{host}:{port}") % 1024) / 1024 * self.interval)
        next_at = loop.time()
        try:
            while True:
                figures = await self._scrape(conn, rec)
                if figures is not None:
                    core.figures = figures
                    ok_c.inc()
                else:
                    err_c.inc()
                self._judge(core, rec, time.monotonic())
                next_at += self.interval
                delay = next_at - loop.time()
                if delay < 0:  # fell behind (a slow scrape): skip, do not burst
                    next_at, delay = loop.time(), 0.0
                await asyncio.sleep(delay)
        finally:
            conn.close()

    async def _scrape(self, conn: Conn, rec: Record) -> Figures | None:
        try:
            async with asyncio.timeout(self.timeout):
                body = await conn.get(self.cfg.max_bytes)
        except TimeoutError:
            self._failed(conn, rec, f"timeout after {self.timeout:g}s")
            return None
        except ssl.SSLError as e:
            self._failed(conn, rec, f"TLS {e.reason or e}")
            return None
        except (OSError, ValueError, ScrapeError, asyncio.IncompleteReadError,
                asyncio.LimitOverrunError) as e:  # fmt: skip
            self._failed(conn, rec, f"{type(e).__name__}: {e}"[:200])
            return None
        f = scan(body, self.want, time.monotonic())
        rec.ok += 1
        if f.missing != rec.missing:
            if f.missing:
                log.warning("metrics: backend=%s member=%s:%s page lacks %s (not read as 0)",
                            self.backend, conn.host, conn.port, ", ".join(f.missing))  # fmt: skip
            rec.missing = f.missing
        return f

    def _failed(self, conn: Conn, rec: Record, why: str) -> None:
        conn.close()
        rec.failed += 1
        if why != rec.last_error:
            log.info("metrics: backend=%s member=%s:%s scrape failed: %s", self.backend,
                     conn.host, conn.port, why)  # fmt: skip
        rec.last_error = why

    def _judge(self, core: Core, rec: Record, now: float) -> None:
        """The pick's `server` term and the admission's `full` from the figures, if fresh."""
        f = core.figures
        is_full = False
        if f is not None and fresh(f, now, self.interval):
            core.server = score(f, core.in_flight, self.weights)
            is_full = full(f, self.max_in_flight)
        else:
            core.server = 0.0
        if is_full != rec.full:
            rec.full = is_full
            self.pool.changed()  # the admission queue recounts its slots
