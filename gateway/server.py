"""`sluice serve`: process lifecycle.

Start order: policy (fatal if invalid) → simulated backend (if the policy asks) → admin → HTTP and
gRPC listeners → ready. SIGHUP reloads the policy; SIGTERM/SIGINT drain: not ready, stop accepting,
let in-flight requests (streams too) finish up to `timeouts.drain_s`, then close in reverse order
and exit 0. `--workers N` runs N such processes on the same ports (SO_REUSEPORT) under the
supervisor of `gateway.supervisor` (replaces a worker that dies, forwards signals).
Every phase ends: a start that fails (a port taken, a required datapath) closes everything it
opened and exits 1 within `drain_s`; SIGTERM/SIGINT while starting abandons the start and exits;
a second one while draining cuts the requests still in flight. Behind these, a watchdog thread
ends the process if stopping ever outlasts its budget (`drain_s` for a failed start, `drain_s` +
`CLOSE_S` otherwise), so a supervisor always sees an exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.errors import GatewayError, PolicyError
from gateway.logs import setup_logging
from gateway.settings import Settings

if TYPE_CHECKING:
    from gateway.services import Services

log = logging.getLogger("sluice.server")

CLOSE_S = 5.0  # closing the listeners and owners, after the drain
# The collector's youngest generation runs once this many more container objects were made
# than freed (CPython's default is 700). A request holds up to ~150 of them (its context, parsed
# bodies, futures) until it ends, so a few dozen requests in flight alone pass 700: the
# collector then ran every few dozen requests, freed nothing (they are alive) and moved them all
# to the older generations, whose runs then walked the whole young heap (the full chain at 32
# connections: ~350 runs a second, 3 µs a request). At 10,000 it runs when garbage (a closed
# connection's cycle, ~15 objects) builds up, or past ~65 such requests in flight.
GC_GEN0_THRESHOLD = 10_000


def configure(parser: argparse.ArgumentParser) -> None:
    s = Settings.from_env()
    parser.add_argument("--policy", type=Path, default=s.policy_path, help="policy YAML file")
    parser.add_argument(
        "--workers", type=int, default=s.workers, help="processes sharing the ports (SO_REUSEPORT)"
    )
    parser.add_argument("--log-level", default=s.log_level, help="DEBUG, INFO, WARNING, ERROR")


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    if args.workers > 1:
        from gateway.supervisor import run_workers

        return run_workers(args)
    from gateway.supervisor import count_replacement

    count_replacement()
    try:
        return _run_loop(
            _serve(args.policy, reuse_port=os.environ.get("SLUICE_WORKER") is not None)
        )
    except PolicyError as e:
        for line in e.errors:
            print(line, file=sys.stderr)
        return 1


def _run_loop(main: Any) -> int:
    try:
        import uvloop
    except ImportError:  # uvloop is optional: the stdlib loop works, only slower
        return int(asyncio.run(main))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return int(runner.run(main))


class Server:
    """Owns the listeners, the admin site, the watcher and the in-process simulated backend."""

    def __init__(
        self, policy_path: Path, *, reuse_port: bool = False, services: Services | None = None
    ) -> None:
        from gateway.app import Gateway

        self.gateway = Gateway(policy_path, services)  # raises PolicyError: fatal at boot
        self.gateway.holder.on_swap(self.after_swap)
        self.reuse_port = reuse_port
        self._stack = contextlib.AsyncExitStack()
        self._stopping = asyncio.Event()
        self._hurry = asyncio.Event()  # a second stop signal while draining
        self._tasks: set[asyncio.Task[Any]] = set()
        self.http: Any = None
        self.grpc: Any = None
        self.admin: Any = None
        self.mock: Any = None
        self.datapath: Any = None
        self.ports: dict[str, int] = {}

    async def start(self) -> None:
        from gateway.admin import start_admin

        # First on the stack, so last to run: whatever fails below, the owners close.
        self._stack.push_async_callback(self.gateway.aclose)
        policy = self.gateway.active.policy.policy
        mock_cfg = policy.mock_backend
        if mock_cfg.enabled and os.environ.get("SLUICE_NO_MOCK") is None:
            from gateway.mockbackend import Knobs, start_mock_backend

            self.mock = await start_mock_backend(
                mock_cfg.http, mock_cfg.grpc, Knobs.from_policy(mock_cfg), mock_cfg.admin
            )
            self._stack.push_async_callback(self.mock.close)
            log.info(
                "simulated backend on http:%s grpc:%s admin:%s",
                self.mock.http_port,
                self.mock.grpc_port,
                self.mock.admin_port,
            )
        from gateway.datapath import Datapath

        # Does nothing while the policy leaves the datapath off (a reload may turn it on).
        # Raises DatapathError only when the policy marks it required; an optional one that
        # fails leaves the gateway serving and says so in /readyz and metrics.
        self.datapath = Datapath(policy.datapath)
        await self.datapath.start()
        self._stack.push_async_callback(self.datapath.stop)
        self.gateway.services.deny = self.datapath.deny  # red overload may shed in the kernel
        lst = policy.listeners
        if lst.admin is not None:
            self.admin = await start_admin(
                self, lst.admin.host, lst.admin.port, reuse_port=self.reuse_port
            )
            self._stack.push_async_callback(self.admin.close)
            self.ports["admin"] = self.admin.port
        if lst.http is not None:
            from gateway.adapters.engines import start_http

            self.http = await start_http(
                self.gateway, lst.http.host, lst.http.port, reuse_port=self.reuse_port
            )
            self.ports["http"] = self.http.port
        if lst.grpc is not None:
            from gateway.adapters.engines import start_grpc

            self.grpc = await start_grpc(self.gateway, lst.grpc.host, lst.grpc.port)
            self.ports["grpc"] = self.grpc.port
        from gateway.reload.watch import PolicyWatcher

        self.watcher = PolicyWatcher(
            self.gateway.holder, interval_s=Settings.from_env().watch_interval_s
        )
        self.watcher.start()
        self._stack.push_async_callback(self.watcher.stop)
        # Everything built so far (modules, policy, pools) lives as long as the process: move it
        # out of the collector's sight, so a full collection walks only per-request garbage.
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])
        self.gateway.ready = True
        from gateway.telemetry import metrics

        metrics.READY.set(1)
        sampler = asyncio.get_running_loop().create_task(self._sample_in_flight())
        self._stack.callback(sampler.cancel)
        ticker = asyncio.get_running_loop().create_task(self._tick_rollouts())
        self._stack.callback(ticker.cancel)
        from gateway import native

        if native.STATE != "compiled" and native.STATE != "pure: SLUICE_PURE=1":
            log.warning("request path interpreted, several times slower: %s", native.STATE[6:])
        # One line a human (and a test) can wait for.
        log.info(
            "sluice ready: %s (policy %s)",
            " ".join(f"{k}={v}" for k, v in self.ports.items()),
            self.gateway.holder.version,
        )

    def reload(
        self, force: bool = False, rollout_fields: dict[str, Any] | None = None, now: bool = False
    ) -> dict[str, object]:
        """SIGHUP and POST /admin/policy/reload come here (the file watcher calls the holder).
        `force`: past the change guard; `rollout_fields`: a staged rollout with these fields;
        `now`: all at once, whatever the policy's `rollout:` says."""
        from gateway.reload.holder import FROM_POLICY

        holder = self.gateway.holder
        if self.stopping:  # the owners are closing: a new policy would start their work again
            log.info("policy reload ignored: the gateway is stopping")
            return holder.status()
        holder.reload(
            force=force, rollout=None if now else FROM_POLICY, rollout_fields=rollout_fields
        )
        return holder.status()

    def after_swap(self) -> None:
        """Work that follows a successful swap: forget upstreams that left the policy, learn
        unary methods again, and push the datapath section into the kernel maps."""
        jobs = []
        if self.datapath is not None:
            jobs.append(self.datapath.update_policy(self.gateway.active.policy.policy.datapath))
        if self.grpc is not None:
            jobs.append(self.grpc.refresh_unary())
        jobs.append(self.gateway.prune_channels())  # nothing to do while no gRPC was proxied
        for job in jobs:
            task = asyncio.get_running_loop().create_task(job)
            self._tasks.add(task)  # keep a reference until it is done
            task.add_done_callback(self._tasks.discard)

    async def _sample_in_flight(self) -> None:
        """The in-flight gauge, set once a second (a gauge write per request would cost more),
        and the request metrics' tallies moved into their children as often
        (`gateway.telemetry.tally`: what other workers' scrapes read)."""
        from gateway.telemetry import metrics

        while True:
            metrics.IN_FLIGHT.set(self.gateway.inflight.count)
            metrics.flush()
            await asyncio.sleep(1.0)

    async def _tick_rollouts(self) -> None:
        """Judge a staged rollout's stage every 0.1 s while one runs (every 0.5 s it looks)."""
        holder = self.gateway.holder
        while True:
            try:
                holder.tick()
            except Exception:  # a bug in judging must not stop the next tick
                log.exception("policy rollout tick failed")
            await asyncio.sleep(0.1 if holder.rollout is not None else 0.5)

    def request_stop(self) -> None:
        if self._stopping.is_set() and self.gateway.draining:
            log.warning("second stop signal: cutting the requests still in flight")
            self._hurry.set()
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def wait(self) -> None:
        await self._stopping.wait()

    async def drain_and_close(self) -> None:
        """Not ready → stop accepting → wait for in-flight requests up to drain_s → close."""
        from gateway.telemetry import metrics

        drain_s = self.gateway.active.policy.policy.timeouts.drain_s
        self.gateway.ready = False
        self.gateway.draining = True
        metrics.READY.set(0)
        log.info(
            "draining: %d requests in flight, up to %.1fs", self.gateway.inflight.count, drain_s
        )
        waits = []
        if self.http is not None:
            await self.http.stop_accepting()
        if self.grpc is not None:
            waits.append(self.grpc.stop(drain_s))
        waits.append(self._wait_idle(drain_s))
        results = await asyncio.gather(*waits, return_exceptions=True)
        if self.gateway.inflight.count:
            log.warning("drain timeout: %d requests cut", self.gateway.inflight.count)
        for r in results:
            if isinstance(r, BaseException):
                log.error("error while draining: %r", r)
        for task in list(self._tasks):  # after-swap jobs still running
            task.cancel()
        try:
            async with asyncio.timeout(CLOSE_S):
                if self.http is not None:
                    await self.http.close(1.0)
                await self._stack.aclose()
        except TimeoutError:
            log.error("closing took longer than %.1fs; left unfinished", CLOSE_S)
        from gateway.telemetry import metrics
        from gateway.telemetry.accesslog import SINK

        metrics.flush()  # the last second's request counts, into the multiprocess files too

        SINK.flush()
        log.info("stopped")

    async def _wait_idle(self, drain_s: float) -> bool:
        """In-flight requests done, or `drain_s` passed, or a second stop signal came."""
        hurry = asyncio.ensure_future(self._hurry.wait())
        idle = asyncio.ensure_future(self.gateway.inflight.wait_idle(drain_s))
        try:
            await asyncio.wait((hurry, idle), return_when=asyncio.FIRST_COMPLETED)
        finally:
            hurry.cancel()
            idle.cancel()
        return idle.done() and not idle.cancelled() and idle.result()


async def _serve(policy_path: Path, *, reuse_port: bool) -> int:
    from gateway.services import Services

    services = Services()
    try:
        server = Server(policy_path, reuse_port=reuse_port, services=services)
    except BaseException:  # an owner built with the first policy may have started work
        await services.aclose()
        raise
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, server.request_stop)
    loop.add_signal_handler(signal.SIGINT, server.request_stop)
    loop.add_signal_handler(signal.SIGHUP, server.reload)
    drain_s = server.gateway.active.policy.policy.timeouts.drain_s
    start = loop.create_task(server.start(), name="sluice-start")
    stop = loop.create_task(server.wait(), name="sluice-stop")
    code = 0
    try:
        await asyncio.wait((start, stop), return_when=asyncio.FIRST_COMPLETED)
        if not start.done():  # a stop signal while starting: abandon the start
            log.info("stop requested while starting")
            start.cancel()
            await asyncio.wait((start,), timeout=CLOSE_S)
        elif start.cancelled() or start.exception() is not None:
            error = None if start.cancelled() else start.exception()
            if isinstance(error, GatewayError | OSError):
                log.error("start failed: %s", error)
            else:
                log.error("start failed", exc_info=error)
            code = 1
            _watchdog(drain_s, code)
        else:
            await stop
    finally:
        stop.cancel()
        if code == 0:
            _watchdog(drain_s + CLOSE_S, 1)
        await server.drain_and_close()
    return code


def _watchdog(budget_s: float, code: int) -> None:
    """End the process with `code` if it is still running `budget_s` from now (a stop that
    hangs in a library call must not leave a process that listens on nothing)."""

    def fire() -> None:
        log.error("stop did not finish within %.1fs: exiting %d", budget_s, code)
        logging.shutdown()
        os._exit(code)

    timer = threading.Timer(budget_s, fire)
    timer.daemon = True
    timer.start()
