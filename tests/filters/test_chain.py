from __future__ import annotations

import json
import logging

import pytest

from gateway.context import RequestContext, Status
from gateway.core.request import RequestInfo, Wire
from gateway.core.verdict import reject
from gateway.filters.access_log import AccessLogFilter
from gateway.filters.chain import Chain
from gateway.filters.request_id import RequestIdFilter
from gateway.filters.routing import RouteFilter
from gateway.policy.compiled import compile_policy
from gateway.policy.model import Policy
from gateway.telemetry.accesslog import AccessLogSink

POLICY = compile_policy(
    Policy.model_validate(
        {
            "backends": [
                {"name": "a", "endpoints": [{"address": "127.0.0.1:1", "weight": 3}]},
                {"name": "b", "endpoints": [{"address": "127.0.0.1:2"}]},
                {"name": "g", "protocol": "grpc", "endpoints": [{"address": "127.0.0.1:3"}]},
                {"name": "off", "endpoints": [{"address": "127.0.0.1:4", "weight": 0}]},
            ],
            "routes": [
                {"name": "grpc", "match": {"protocol": "grpc"}, "backend": "g"},
                {"name": "off", "match": {"path_prefix": "/off"}, "backend": "off"},
                {
                    "name": "tenant",
                    "match": {
                        "path_prefix": "/v1/",
                        "headers": [{"name": "X-Tenant", "value": "b"}],
                    },
                    "backend": "b",
                },
                {
                    "name": "split",
                    "match": {"path_prefix": "/v1/", "methods": ["post"]},
                    "backends": [{"backend": "a", "weight": 1}, {"backend": "b", "weight": 1}],
                },
            ],
        }
    )
)


def ctx_for(
    path: str,
    method: str = "POST",
    headers: dict[str, str] | None = None,
    protocol: Wire = Wire.HTTP,
) -> RequestContext:
    info = RequestInfo(protocol, method, path, headers or {}, peer="10.0.0.1")
    return RequestContext(info=info, policy=POLICY)


class Recorder:
    def __init__(self, name: str, log: list[str], stop: bool = False, boom: bool = False) -> None:
        self.name, self.log, self.stop_, self.boom = name, log, stop, boom

    async def on_request(self, ctx: RequestContext) -> Status:
        self.log.append(f"req:{self.name}")
        return ctx.stop(reject(429, 8, "x", "y")) if self.stop_ else Status.CONTINUE

    async def on_response(self, ctx: RequestContext) -> None:
        self.log.append(f"resp:{self.name}")
        if self.boom:
            raise RuntimeError("filter bug")


async def test_chain_runs_in_order_and_unwinds_only_what_ran() -> None:
    log: list[str] = []
    chain = Chain([Recorder("a", log), Recorder("b", log, stop=True), Recorder("c", log)])
    ctx = ctx_for("/v1/x")
    assert await chain.on_request(ctx) is Status.STOP
    assert ctx.verdict.http_status == 429
    await chain.on_response(ctx)
    assert log == ["req:a", "req:b", "resp:b", "resp:a"]


async def test_one_failing_on_response_does_not_hide_the_others() -> None:
    log: list[str] = []
    chain = Chain([Recorder("a", log), Recorder("b", log, boom=True)])
    ctx = ctx_for("/v1/x")
    assert await chain.on_request(ctx) is Status.CONTINUE
    await chain.on_response(ctx)
    assert log == ["req:a", "req:b", "resp:b", "resp:a"]


@pytest.mark.parametrize(
    ("path", "method", "headers", "protocol", "route"),
    [
        ("/pkg.S/M", "POST", {}, Wire.GRPC, "grpc"),
        ("/v1/chat", "POST", {"x-tenant": "b"}, Wire.HTTP, "tenant"),
        ("/v1/chat", "POST", {"x-tenant": "c"}, Wire.HTTP, "split"),
        ("/v1/chat", "GET", {}, Wire.HTTP, None),
        ("/other", "POST", {}, Wire.HTTP, None),
    ],
)
async def test_route_matching(
    path: str, method: str, headers: dict[str, str], protocol: Wire, route: str | None
) -> None:
    ctx = ctx_for(path, method, headers, protocol)
    status = RouteFilter(POLICY).on_request(ctx)
    if route is None:
        assert status is Status.STOP
        assert (ctx.verdict.http_status, ctx.verdict.grpc_status) == (404, 12)
    else:
        assert status is Status.CONTINUE
        assert ctx.route is not None and ctx.route.name == route


async def test_weight_zero_backend_gives_503_with_retry_after() -> None:
    ctx = ctx_for("/off")
    assert RouteFilter(POLICY).on_request(ctx) is Status.STOP
    assert ctx.verdict.http_status == 503 and ctx.verdict.retry_after


async def test_weighted_split_follows_weights() -> None:
    f = RouteFilter(POLICY)
    seen: dict[int, int] = {}
    for _ in range(800):
        ctx = ctx_for("/v1/x")
        f.on_request(ctx)
        assert ctx.endpoint is not None
        seen[ctx.endpoint.port] = seen.get(ctx.endpoint.port, 0) + 1
    # route weights 1:1 between backends a and b; a has one endpoint
    assert seen == {1: 400, 2: 400}


@pytest.mark.parametrize(
    ("incoming", "kept"),
    [
        ("abc-123", True),
        ("x" * 129, False),
        ("bad id\r\n", False),
        ("abc\n", False),  # `$` alone would match before the newline
        (None, False),
    ],
)
async def test_request_id(incoming: str | None, kept: bool) -> None:
    ctx = ctx_for("/v1/x", headers={"x-request-id": incoming} if incoming else {})
    RequestIdFilter().on_request(ctx)
    assert (ctx.request_id == incoming) is kept
    assert ctx.upstream_headers["x-request-id"] == ctx.request_id
    assert len(ctx.request_id) <= 128


async def test_access_log_never_logs_credentials(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sluice.access")  # as `sluice serve` sets it
    policy = compile_policy(
        Policy.model_validate({"access_log": {"headers": ["Authorization", "X-Tenant"]}})
    )
    written: list[bytes] = []
    f = AccessLogFilter(policy.policy.access_log, sink=AccessLogSink(written.append))
    ctx = ctx_for('/v1/"x"\n\u00e9', headers={"authorization": "Bearer secret", "x-tenant": "t1"})
    ctx.http_status = 200
    f.on_response(ctx)
    f.on_response(ctx)
    f._sink.flush()
    (batch,) = written  # two lines, one write
    lines = batch.decode().splitlines()
    assert len(lines) == 2
    entry = json.loads(lines[0])
    assert entry["status"] == 200 and entry["h_x-tenant"] == "t1"
    assert entry["path"] == '/v1/"x"\n\u00e9' and entry["route"] is None
    assert entry["grpc_status"] is None and entry["duration_ms"] >= 0
    assert "secret" not in batch.decode()
    assert "h_authorization" not in entry


async def test_access_log_sink_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.telemetry.accesslog as accesslog

    monkeypatch.setattr(accesslog, "MAX_PENDING_BYTES", 100)
    monkeypatch.setattr(accesslog, "FLUSH_BYTES", 10_000)
    written: list[bytes] = []
    sink = AccessLogSink(written.append)
    for _ in range(10):
        sink.emit("x" * 30)
    sink.flush()
    assert written == [b"\n".join([b"x" * 30] * 3) + b"\n"]


async def test_access_log_learns_repeated_values_as_literals_within_bounds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import gateway.filters.access_log as access_log

    caplog.set_level(logging.INFO, logger="sluice.access")
    written: list[bytes] = []
    f = AccessLogFilter(POLICY.policy.access_log, sink=AccessLogSink(written.append))
    route = RouteFilter(POLICY)
    paths = ['/v1/"q"\u00e9', "/v1/x", "/v1/" + "y" * access_log.LEARNED_CHARS]
    paths += [f"/v1/n{i}" for i in range(access_log.LEARNED_MAX + 5)]
    for path in paths * 2:  # each value twice: learned, then used
        ctx = ctx_for(path)
        route.on_request(ctx)
        RequestIdFilter().on_request(ctx)
        ctx.http_status = 200
        f.on_response(ctx)
    f._sink.flush()
    entries = [json.loads(line) for line in b"".join(written).decode().splitlines()]
    assert [e["path"] for e in entries] == paths * 2  # escaped exactly, learned or not
    assert {e["route"] for e in entries} == {"split"}
    assert {e["backend"] for e in entries} == {"a", "b"}
    assert {e["upstream"] for e in entries} == {"127.0.0.1:1", "127.0.0.1:2"}
    assert all(len(e["request_id"]) == 32 and e["peer"] == "10.0.0.1" for e in entries)
    learned = f._learned
    assert len(learned) == access_log.LEARNED_MAX
    assert learned['/v1/"q"\u00e9'] == '"/v1/\\"q\\"\\u00e9"'
    assert all(len(v) <= access_log.LEARNED_CHARS for v in learned)
    assert paths[2] not in learned  # over the length bound: escaped as it comes
