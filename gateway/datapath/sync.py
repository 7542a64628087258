"""Keep the kernel classifier in step with the gateway: attach on start, write the policy into
maps, push deny entries, and read kernel counters into Prometheus every sync interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from gateway.errors import DatapathError
from gateway.telemetry import edge_metrics

if TYPE_CHECKING:
    from gateway.datapath.loader import BpfProgram
    from gateway.datapath.maps import Maps
    from gateway.policy.model import Datapath as DatapathPolicy

log = logging.getLogger("sluice.datapath")

# Kernel counters that grow when the classifier blocks a flow (maps.STAT_NAMES).
BLOCKING_STATS = ("rapid_reset_flows", "header_block_flows", "ping_flood_flows")


class Datapath:
    """The gateway's handle on the classifier.

    start() attaches (or atomically re-attaches after a restart: pinned maps keep counters and
    deny entries) and starts the sync loop. If attaching fails and the policy does not mark the
    datapath `required`, the gateway keeps serving without it: status() says why, and
    `sluice_datapath_up` is 0. With `required`, start() raises DatapathError.
    """

    def __init__(self, policy: DatapathPolicy, *, netns: str | None = None) -> None:
        self.policy = policy
        self.netns = netns
        self._prog: BpfProgram | None = None
        self._maps: Maps | None = None
        self._task: asyncio.Task[None] | None = None
        self._error: str | None = None
        self._last_sync: float | None = None
        self._seen: dict[str, int] = {}
        self._stats: dict[str, int] = {}
        self._denied = 0
        self._reset: set[tuple[str, int, str, int]] = set()  # blocked flows already closed

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        edge_metrics.DATAPATH_UP.set(0)
        if not self.policy.enabled:
            return
        try:
            await asyncio.to_thread(self._attach, self.policy)
        except DatapathError as exc:
            self._error = str(exc)
            if self.policy.required:
                raise
            log.warning("datapath optional and unavailable, serving without it: %s", exc)
            return
        edge_metrics.DATAPATH_UP.set(1)
        self._task = asyncio.create_task(self._loop(), name="sluice-datapath-sync")

    async def stop(self, *, detach: bool = False) -> None:
        """Stop syncing. The filter stays attached (a restart re-attaches to it) unless
        `detach`, which removes the filter and the pinned maps."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        prog, self._prog, self._maps = self._prog, None, None
        if prog is not None:
            if detach:
                await asyncio.to_thread(prog.detach)
            prog.close()
        edge_metrics.DATAPATH_UP.set(0)

    async def update_policy(self, policy: DatapathPolicy) -> None:
        """A policy reload: rewrite maps; table sizes or interface changed -> reload the program."""
        old, self.policy = self.policy, policy
        if self._prog is None or not policy.enabled:
            if self._prog is not None:
                await self.stop()
            if policy.enabled:
                await self.start()
            return
        from gateway.datapath.maps import build_options

        if build_options(old) != build_options(policy) or old.interface != policy.interface:
            await self.stop(detach=old.interface != policy.interface)
            await self.start()
            return
        assert self._maps is not None
        await asyncio.to_thread(self._maps.apply_policy, policy)

    # -- what the gateway calls ------------------------------------------------------------
    def deny(self, src_ip: str, ttl_s: float | None = None) -> bool:
        """Shed `src_ip` in the kernel for ttl_s (default: policy deny_ttl_s). False when the
        datapath is not running (the caller then sheds in user space)."""
        if self._maps is None:
            return False
        try:
            self._maps.deny(src_ip, self.policy.deny_ttl_s if ttl_s is None else ttl_s)
        except (OSError, KeyError, ValueError) as exc:
            log.warning("deny %s failed: %s", src_ip, exc)
            edge_metrics.DATAPATH_SYNC_ERRORS.inc()
            return False
        return True

    def undeny(self, src_ip: str) -> None:
        if self._maps is not None:
            self._maps.undeny(src_ip)

    def status(self) -> dict[str, Any]:
        """For /readyz detail and /status: state is off, attached or unavailable."""
        if not self.policy.enabled:
            state = "off"
        elif self._prog is not None:
            state = "attached"
        else:
            state = "unavailable"
        return {
            "state": state,
            "interface": self.policy.interface,
            "required": self.policy.required,
            "error": self._error,
            "pinned": str(self._prog.pin_dir) if self._prog and self._prog.pin_dir else None,
            "last_sync_age_s": (
                round(time.monotonic() - self._last_sync, 3) if self._last_sync else None
            ),
            "stats": dict(self._stats),
            "denied_sources": self._denied,
        }

    # -- internals -------------------------------------------------------------------------
    def _attach(self, policy: DatapathPolicy) -> None:
        from gateway.datapath.loader import BpfProgram
        from gateway.datapath.maps import Maps, build_options

        prog = BpfProgram(
            policy.interface, netns=self.netns, options=build_options(policy), egress=policy.egress
        )
        try:
            prog.load()
            maps = Maps(prog)
            maps.apply_policy(policy)  # before attach: the new program starts with the budgets
            prog.attach()
        except Exception:
            prog.close()
            raise
        self._prog, self._maps, self._error = prog, maps, None

    def sync_once(self) -> None:
        """Read kernel counters into metrics (blocking: run in a thread)."""
        maps = self._maps
        if maps is None:
            return
        stats = maps.stats()
        for name, value in stats.items():
            prev = self._seen.get(name, 0)
            delta = value - prev if value >= prev else value  # maps recreated: start over
            if delta:
                edge_metrics.DATAPATH_EVENTS.labels(name).inc(delta)
            self._seen[name] = value
        if any(self._stats.get(k, 0) != stats.get(k, 0) for k in BLOCKING_STATS):
            self._close_blocked(maps)  # only then: reading the whole flow table costs
        self._stats = stats
        self._denied = len(maps.denied())
        edge_metrics.DATAPATH_DENIED.set(self._denied)
        self._last_sync = time.monotonic()

    def _close_blocked(self, maps: Maps) -> None:
        """Abort the server end of every flow the kernel blocked since the last look, so that
        its owner (grpc) frees the connection now rather than when TCP gives up (~15 min)."""
        from gateway.datapath.reset import destroy

        blocked = {(f.dst, f.dport, f.src, f.sport) for f in maps.flows() if f.blocked}
        self._reset &= blocked  # the LRU flow table bounds both sets
        for key in blocked - self._reset:
            self._reset.add(key)
            try:
                closed = destroy((key[0], key[1]), (key[2], key[3]), self.netns)
            except OSError as exc:
                log.warning("closing blocked flow %s:%d failed: %s", key[2], key[3], exc)
                edge_metrics.DATAPATH_SYNC_ERRORS.inc()
                continue
            if closed:
                edge_metrics.DATAPATH_EVENTS.labels("blocked_flows_closed").inc()
                log.info("closed blocked flow from %s:%d", key[2], key[3])

    async def _loop(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.sync_once)
                edge_metrics.DATAPATH_UP.set(1)
            except Exception as exc:  # noqa: BLE001 - keep syncing; the metric shows it
                log.warning("datapath sync failed: %s", exc)
                edge_metrics.DATAPATH_SYNC_ERRORS.inc()
                edge_metrics.DATAPATH_UP.set(0)
            await asyncio.sleep(self.policy.sync_interval_s)
