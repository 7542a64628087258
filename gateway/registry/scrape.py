"""Scrapes of the members' model servers (`backends[].load.metrics`): one small loop per member
that reads the server's Prometheus page and leaves its figures on the member's shared state
(`Core.figures`, `Core.server`), where the pick and the admission queue read them.

Cheap on purpose, since it runs every 100 ms per member:
- one keep-alive HTTP/1.1 connection per member, an asyncio protocol driven by callbacks (no
  client library, no task or future per scrape, no connection per scrape);
- the page is scanned for the few names wanted (`gateway.core.serverload.scan`), never parsed;
- each scrape has a deadline (`timeout_ms`) and a size bound (`max_bytes`): a slow or huge page
  fails it;
- members are staggered over the interval by a hash of their address (one task per backend
  sends each tick's requests), so 100 members at 100 ms are 10 scrapes every 10 ms, not a burst
  of 100 every 100 ms.

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
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, cast

from gateway.core.balancer import hash_key
from gateway.core.serverload import Weights, fresh, full, scan, score, wanted
from gateway.telemetry import metrics

if TYPE_CHECKING:
    from gateway.policy.backends import ServerMetrics
    from gateway.registry.member import Core, Member, MemberBooks
    from gateway.services import Services
    from gateway.tls.upstream import ClientTls

log = logging.getLogger("sluice.backends")

MAX_HEAD = 16 * 1024  # status line and headers of the metrics page's answer
TICK_S = 0.01  # the scrapes of one interval are spread over ticks of about this


class PageClient(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to one metrics page, driven by callbacks: `send`
    writes the request; `data_received` assembles the answer (Content-Length or chunked, at most
    `limit` bytes) and hands the body to `on_page` (the bytes and where the body starts in
    them), or a reason to `on_error` (which closes)."""

    def __init__(
        self, request: bytes, limit: int, on_page: Callable[[bytes | bytearray, int], None],
        on_error: Callable[[str], None],
    ) -> None:  # fmt: skip
        self.request = request
        self.limit = limit
        self.on_page = on_page
        self.on_error = on_error
        self.transport: asyncio.Transport | None = None
        self.pending = False  # a request is out, its answer not complete
        self.buf = bytearray()
        self.body_at = -1  # where the body starts (-1: head not read yet)
        self.length = 0  # Content-Length (-1: chunked)
        self.status = b""
        self.close_after = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def send(self) -> None:
        assert self.transport is not None
        self.pending = True
        self.buf.clear()
        self.body_at = -1
        self.transport.write(self.request)

    def close(self) -> None:
        self.pending = False
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.pending:
            self.pending = False
            self.on_error(f"connection closed{f': {exc}' if exc else ''}")

    def data_received(self, data: bytes) -> None:
        if not self.pending:
            self.fail("bytes nobody asked for")
            return
        buf = self.buf
        buf += data
        if self.body_at < 0 and not self._head():
            return
        if len(buf) - self.body_at > (self.limit if self.length >= 0 else 2 * self.limit) + 64:
            self.fail("page is over max_bytes")  # (chunked: its framing counted loosely)
        elif self.length >= 0:
            end = self.body_at + self.length
            if len(buf) == end:  # the common case: scanned in place, from the body's start
                self._done(buf, self.body_at)
            elif len(buf) > end:
                self._done(bytes(memoryview(buf)[self.body_at : end]), 0)
        elif buf.endswith(b"0\r\n\r\n"):
            body = _dechunk(buf, self.body_at)
            if body is not None and len(body) > self.limit:
                self.fail("page is over max_bytes")
            elif body is not None:
                self._done(body, 0)

    def _head(self) -> bool:
        buf = self.buf
        h = buf.find(b"\r\n\r\n")
        if h < 0:
            if len(buf) > MAX_HEAD:
                self.fail("answer head too large")
            return False
        head = bytes(buf[: h + 2]).lower()
        if not head.startswith(b"http/1.") or head[8:9] != b" ":
            self.fail("not an HTTP/1.1 answer")
            return False
        self.status = head[9:12]
        self.close_after = b"\r\nconnection: close" in head
        i = head.find(b"\r\ncontent-length:")
        if i >= 0:
            v = head[i + 17 : head.find(b"\r\n", i + 17)].strip()
            if not v.isdigit():
                self.fail("bad content-length")
                return False
            length = int(v)
        elif b"\r\ntransfer-encoding: chunked" in head:
            length = -1
        else:
            self.fail("answer without a length")
            return False
        if length > self.limit:
            self.fail(f"page of {length} bytes is over max_bytes")
            return False
        self.length = length
        self.body_at = h + 4
        return True

    def _done(self, body: bytes | bytearray, start: int) -> None:
        self.pending = False
        status = self.status
        if self.close_after:
            self.close()
        if status != b"200":
            self.on_error(f"status {status.decode('latin-1')}")
            self.close()
            return
        self.on_page(body, start)

    def fail(self, why: str) -> None:
        self.close()
        self.on_error(why)


def _dechunk(buf: bytearray, at: int) -> bytes | None:
    """A chunked body's bytes, or None when malformed."""
    out = bytearray()
    while True:
        eol = buf.find(b"\r\n", at)
        if eol < 0:
            return None
        try:
            size = int(bytes(buf[at:eol]).split(b";", 1)[0].strip(), 16)
        except ValueError:
            return None
        if size == 0:
            return bytes(out)
        out += buf[eol + 2 : eol + 2 + size]
        at = eol + 2 + size + 2


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


class Target:
    """One member's scrapes: its connection (opened on first use, again after a failure), the
    request out, and what it leaves on the member's `Core`."""

    __slots__ = ("scraper", "core", "rec", "host", "port", "tls", "client", "connecting",
                 "sent_at", "request")  # fmt: skip

    def __init__(self, scraper: Scraper, core: Core, host: str, port: int,
                 tls: ClientTls | None) -> None:  # fmt: skip
        self.scraper = scraper
        self.core = core
        self.rec = core.scrape = Record(scraper.interval)
        self.host, self.port, self.tls = host, port, tls
        self.client: PageClient | None = None
        self.connecting: asyncio.Task[None] | None = None
        self.sent_at = 0.0
        hosthdr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.request = (f"GET {scraper.cfg.path} HTTP/1.1\r\nHost: {hosthdr}\r\n"
                        "User-Agent: sluice-scrape\r\nAccept: text/plain\r\n\r\n"
                        ).encode("latin-1")  # fmt: skip

    def fire(self, now: float) -> None:
        """This member's turn: judge its figures' age, then send the next request (unless one
        is still out within its deadline)."""
        sc = self.scraper
        if self.core.scrape is self.rec:
            sc.judge(self.core, self.rec, now)
        c = self.client
        if c is None or c.transport is None:
            if self.connecting is None:
                self.connecting = sc.services.spawn(self._connect(), "scrape:connect")
            return
        if c.pending:
            if now - self.sent_at > sc.timeout:
                c.close()
                self.error(f"timeout after {sc.timeout:g}s")
            return
        self.sent_at = now
        c.send()

    async def _connect(self) -> None:
        sc = self.scraper
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(sc.timeout):
                if self.tls is None:
                    _, c = await loop.create_connection(self._client, self.host, self.port)
                else:
                    _, c = await loop.create_connection(
                        self._client, self.host, self.port, ssl=self.tls.context,
                        server_hostname=self.tls.server_hostname(self.host),
                    )  # fmt: skip
        except TimeoutError:
            self.error(f"connect timeout after {sc.timeout:g}s")
        except ssl.SSLError as e:
            self.error(f"TLS {e.reason or e}")
        except OSError as e:
            self.error(f"{type(e).__name__}: {e}"[:200])
        else:
            self.client = c
            self.sent_at = loop.time()
            c.send()
        finally:
            self.connecting = None

    def _client(self) -> PageClient:
        return PageClient(self.request, self.scraper.cfg.max_bytes, self.page, self.error)

    def page(self, body: bytes | bytearray, start: int) -> None:
        sc, rec = self.scraper, self.rec
        if self.core.scrape is not rec:
            return  # a newer section's scrapes own the member (this one stops at the sweep)
        f = scan(body, sc.want, time.monotonic(), start)
        self.core.figures = f
        rec.ok += 1
        sc.ok.inc()
        if f.missing != rec.missing:
            if f.missing:
                log.warning("metrics: backend=%s member=%s:%s page lacks %s (not read as 0)",
                            sc.backend, self.host, self.port, ", ".join(f.missing))  # fmt: skip
            rec.missing = f.missing
        sc.judge(self.core, rec, f.at)

    def error(self, why: str) -> None:
        sc, rec = self.scraper, self.rec
        rec.failed += 1
        sc.failed.inc()
        if why != rec.last_error:
            log.info("metrics: backend=%s member=%s:%s scrape failed: %s", sc.backend,
                     self.host, self.port, why)  # fmt: skip
        rec.last_error = why

    def stop(self) -> None:
        if self.connecting is not None:
            self.connecting.cancel()
        if self.client is not None:
            self.client.close()
        core = self.core
        if core.scrape is self.rec:  # (a newer section's scrapes may own the member already)
            core.scrape = None
            core.figures = None
            core.server = 0.0


class Scraper:
    """One `load.metrics` section of one backend: the scrapes of its members (added and removed
    by `sync` as members come and go; `stop` ends them all). One task drives them all: the
    interval is cut into ticks of about `TICK_S`, each member has its tick (by a hash of its
    address), and a tick sends the requests of its members; answers are read by callbacks."""

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
        self.ticks = max(1, round(self.interval / TICK_S))
        self.slots: list[list[Target]] = [[] for _ in range(self.ticks)]
        self.targets: dict[str, Target] = {}
        self.task: asyncio.Task[None] | None = None
        self.ok = metrics.SERVER_SCRAPES.labels(backend, "ok")
        self.failed = metrics.SERVER_SCRAPES.labels(backend, "error")

    def sync(self, members: Iterable[Member]) -> None:
        """Scrape exactly these members (needs a running loop)."""
        seen = set()
        for m in members:
            seen.add(m.address)
            if m.address not in self.targets:
                t = self.targets[m.address] = Target(self, m.core, *self._target(m))
                self.slots[hash_key(m.address) % self.ticks].append(t)
        for address in [a for a in self.targets if a not in seen]:
            self._end(address)
        if self.targets and (self.task is None or self.task.done()):
            self.task = self.services.spawn(self._run(), f"scrape:{self.backend}")

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
        t = self.targets.pop(address)
        for slot in self.slots:
            if t in slot:
                slot.remove(t)
        t.stop()

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None
        for address in list(self.targets):
            self._end(address)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        step = self.interval / self.ticks
        k = 0
        next_at = loop.time()
        while True:
            now = loop.time()
            for t in self.slots[k]:
                t.fire(now)
            k = k + 1 if k + 1 < self.ticks else 0
            next_at += step
            delay = next_at - loop.time()
            if delay < 0:  # fell behind (a busy loop): go on from now, do not burst
                next_at, delay = loop.time(), 0.0
            await asyncio.sleep(delay)

    def judge(self, core: Core, rec: Record, now: float) -> None:
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
