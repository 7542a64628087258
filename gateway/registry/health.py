"""Active health checks of backend members: one small loop per member, owned by the services.

HTTP backends: `GET <path>` (default `/healthz?deep=true`) on a connection of its own (not the
request pool: a check must not queue behind traffic), 2xx passes. gRPC backends:
`grpc.health.v1.Health/Check` for `grpc_service` ('' = the whole server), SERVING passes.
Each check has a deadline (`timeout_s`); a timeout, refused connection, failed TLS handshake or
bad answer fails. A backend with a `tls` section is checked over TLS with the contexts built at
policy load (the same as its traffic's).

The thresholds and intervals are `gateway.core.health`'s: checks every `interval_s`, every
`failing_interval_s` while failing, ±jitter; the first check runs within a second of the member
appearing. Passive health: a failure seen in real traffic (`Member.poke`) runs a check at once
(at most once per second), so a dead member is found between two slow intervals.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import TYPE_CHECKING, Any

from gateway.telemetry import metrics
from gateway.tls.upstream import grpc_tls_reason, tls_reason

if TYPE_CHECKING:
    from gateway.registry.member import HealthBox, MemberBooks
    from gateway.services import Services
    from gateway.tls.upstream import ClientTls

log = logging.getLogger("sluice.backends")

MAX_STATUS_LINE = 1024
POKE_MIN_GAP_S = 1.0


async def check_http(
    host: str, port: int, path: str, timeout: float, tls: ClientTls | None = None
) -> tuple[bool, str]:
    """One `GET path` (over TLS with the backend's context if it has one): (passed, error)."""
    writer = None
    try:
        async with asyncio.timeout(timeout):  # the TLS handshake included
            if tls is None:
                reader, writer = await asyncio.open_connection(host, port)
            else:
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=tls.context, server_hostname=tls.server_hostname(host)
                )
            hosthdr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: {hosthdr}\r\nUser-Agent: sluice-health\r\n"
                "Connection: close\r\n\r\n".encode("latin-1")
            )
            await writer.drain()
            line = await reader.readline()
    except TimeoutError:
        return False, f"timeout after {timeout:g}s"
    except ssl.SSLError as e:
        return False, f"TLS {tls_reason(e)}"
    except (OSError, ValueError) as e:  # ValueError: a status line over the reader's limit
        return False, f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            writer.close()
    parts = line[:MAX_STATUS_LINE].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return False, "not an HTTP answer"
    status = int(parts[1])
    return (200 <= status < 300), ("" if 200 <= status < 300 else f"status {status}")


async def check_grpc(channel: Any, service: str, timeout: float) -> tuple[bool, str]:
    """One grpc.health.v1 Check: (passed, error text)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.aio.AioRpcError as e:
        return False, f"{e.code().name}: {grpc_tls_reason(e.details() or '')[:160]}"
    except Exception as e:  # a broken channel: the check fails, the loop goes on
        return False, f"{type(e).__name__}: {e}"
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return True, ""
    return False, health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def _loop(pool: MemberBooks, box: HealthBox) -> None:
    hc = box.check
    rng = pool.random
    channel: Any = None
    if box.protocol == "grpc":
        import grpc.aio

        address = f"[{box.host}]:{box.port}" if ":" in box.host else f"{box.host}:{box.port}"
        options = (("grpc.enable_retries", 0),)
        if box.tls is None:
            channel = grpc.aio.insecure_channel(address, options=options)
        else:
            channel = grpc.aio.secure_channel(
                address, box.tls.grpc_credentials, options=options + box.tls.grpc_options()
            )
    last = 0.0
    state = box.state
    try:
        await asyncio.sleep(rng() * min(1.0, hc.interval_s))
        while True:
            last = time.monotonic()
            if channel is not None:
                ok, err = await check_grpc(channel, hc.grpc_service, hc.timeout_s)
            else:
                ok, err = await check_http(box.host, box.port, hc.path, hc.timeout_s, box.tls)
            metrics.HEALTH_CHECKS.labels(box.backend, "pass" if ok else "fail").inc()
            if state.observe(ok, err):
                pool.changed()
                log.warning("health: backend=%s member=%s:%s %s%s", box.backend, box.host,
                            box.port, "healthy" if state.healthy else "unhealthy",
                            "" if state.healthy else f" ({state.last_error})")  # fmt: skip
            poke = box.poke
            if poke is None:
                return
            poke.clear()
            try:
                async with asyncio.timeout(state.next_delay(rng())):
                    await poke.wait()
                gap = POKE_MIN_GAP_S - (time.monotonic() - last)
                if gap > 0:
                    await asyncio.sleep(gap)
            except TimeoutError:
                pass
    finally:
        if channel is not None:
            await channel.close(None)


def start_checker(services: Services, pool: MemberBooks, box: HealthBox) -> None:
    box.poke = asyncio.Event()
    box.checker = services.spawn(_loop(pool, box), f"health:{box.backend}:{box.host}:{box.port}")
