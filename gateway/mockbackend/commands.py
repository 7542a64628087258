"""`sluice mock-backend`: run the simulated inference backend until SIGTERM or SIGINT.

`--tls-cert/--tls-key` serve HTTP and gRPC over TLS (`--tls-client-ca` requires client
certificates): a backend to try Sluice's upstream TLS against. The admin API stays plaintext."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from gateway.mockbackend.knobs import FAILURE_MODES

log = logging.getLogger("gateway.mockbackend")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--http", default="127.0.0.1:18000", help="HTTP listener host:port")
    parser.add_argument("--grpc", default="127.0.0.1:18001", help="gRPC listener host:port")
    parser.add_argument("--no-http", action="store_true", help="do not serve HTTP")
    parser.add_argument("--no-grpc", action="store_true", help="do not serve gRPC")
    parser.add_argument(
        "--admin",
        default="127.0.0.1:0",
        help="admin listener host:port (/admin/knobs, /admin/stats, /admin/reset); loopback "
        "only; default: a free loopback port, printed at start (two backends never collide)",
    )
    parser.add_argument("--no-admin", action="store_true", help="do not serve the admin API")
    parser.add_argument(
        "--tls-cert",
        metavar="PEM",
        help="serve HTTP and gRPC over TLS with this certificate (chain); needs --tls-key",
    )
    parser.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    parser.add_argument(
        "--tls-client-ca",
        metavar="PEM",
        help="require client certificates signed by this CA (mutual TLS); needs --tls-cert",
    )
    parser.add_argument("--ttft-ms", type=float, default=50.0, help="time to first token (ms)")
    parser.add_argument("--token-delay-ms", type=float, default=10.0, help="delay per token (ms)")
    parser.add_argument(
        "--completion-tokens", type=int, default=16, help="tokens per answer (max_tokens caps)"
    )
    parser.add_argument(
        "--slots", type=int, default=0, help="generation slots; completions beyond wait (0: any)"
    )
    parser.add_argument("--error-rate", type=float, default=0.0, help="share of requests failed")
    parser.add_argument("--failure", choices=FAILURE_MODES, default="none", help="inject a failure")
    parser.add_argument("--seed", type=int, default=0, help="seed of the error_rate draws")
    parser.add_argument(
        "--models",
        default="",
        help="comma-separated models served (listed in /v1/models; other models get 404); "
        "default: the built-in list, any model answered",
    )
    parser.add_argument(
        "--prefix-cache-blocks",
        type=int,
        default=0,
        help="prompt-prefix blocks its cache keeps (LRU; 0 = no cache)",
    )
    parser.add_argument(
        "--uncached-token-ms",
        type=float,
        default=0.0,
        help="time to first token per prompt token not in the cache, on top of --ttft-ms",
    )
    parser.add_argument(
        "--prefill-slots", type=int, default=0, help="prefills served at once (0 = no limit)"
    )
    parser.add_argument(
        "--adapters",
        default="",
        help="comma-separated LoRA adapters as ADAPTER=PARENT (listed with their parent)",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level")


async def _serve(args: argparse.Namespace) -> int:
    from gateway.mockbackend.knobs import Knobs
    from gateway.mockbackend.server import start_mock_backend
    from gateway.mockbackend.tls import ServerTls

    patch = {
        "ttft_ms": args.ttft_ms,
        "token_delay_ms": args.token_delay_ms,
        "completion_tokens": args.completion_tokens,
        "error_rate": args.error_rate,
        "failure": args.failure,
        "seed": args.seed,
        "prefix_cache_blocks": args.prefix_cache_blocks,
        "uncached_token_ms": args.uncached_token_ms,
        "prefill_slots": args.prefill_slots,
        "models": [m for m in args.models.split(",") if m],
        "adapters": dict(a.partition("=")[::2] for a in args.adapters.split(",") if a),
        "slots": args.slots,
    }
    try:
        knobs = Knobs().validated(patch)
    except ValueError as exc:
        log.error("bad knob: %s", exc)
        return 2
    tls = None
    if args.tls_cert or args.tls_key or args.tls_client_ca:
        if not (args.tls_cert and args.tls_key):
            log.error("--tls-cert and --tls-key go together (--tls-client-ca needs both)")
            return 2
        tls = ServerTls(args.tls_cert, args.tls_key, args.tls_client_ca)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        handle = await start_mock_backend(
            None if args.no_http else args.http,
            None if args.no_grpc else args.grpc,
            knobs,
            None if args.no_admin else args.admin,
            tls,
        )
    except ValueError as exc:
        log.error("cannot start the mock backend: %s", exc)
        return 2
    try:
        log.info(
            "mock backend listening: http port %s, grpc port %s, admin port %s",
            handle.http_port,
            handle.grpc_port,
            handle.admin_port,
        )
        if handle.admin_port is not None:
            host = args.admin.rpartition(":")[0]
            log.info("mock backend admin API: http://%s:%s/admin/knobs", host, handle.admin_port)
        await stop.wait()
        log.info("mock backend stopping")
    finally:
        await handle.close()
    return 0


def run(args: argparse.Namespace) -> int:
    import uvloop

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        code: int = uvloop.run(_serve(args))
    except OSError as exc:
        log.error("cannot start the mock backend: %s", exc)
        return 1
    return code
