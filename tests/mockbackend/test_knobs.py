"""Knob validation, stats bookkeeping and the shared token helpers (no sockets)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.mockbackend import Knobs, MockState, start_mock_backend
from gateway.mockbackend.knobs import Seen, Stats, completion_count, estimate_tokens
from gateway.mockbackend.server import split_host_port
from gateway.policy.model import MockBackend


def test_from_policy() -> None:
    cfg = MockBackend(ttft_ms=1.5, token_delay_ms=2.0, completion_tokens=7)
    knobs = Knobs.from_policy(cfg)
    assert (knobs.ttft_ms, knobs.token_delay_ms, knobs.completion_tokens) == (1.5, 2.0, 7)
    assert knobs.failure == "none"


@pytest.mark.parametrize(
    "patch",
    [
        {"failure": "explode"},
        {"error_rate": -0.1},
        {"completion_tokens": 1.5},
        {"ttft_ms": True},
        {"error_status": 404},
        {"usage_trailer": "X-Upper"},
        {"healthy": "yes"},
        {"unknown": 1},
    ],
)
def test_validation_rejects(patch: dict[str, object]) -> None:
    knobs = Knobs()
    with pytest.raises(ValueError):
        knobs.validated(patch)
    assert knobs == Knobs()


def test_validation_normalises() -> None:
    knobs = Knobs().validated({"ttft_ms": 5, "failure": "reset", "load": 1})
    assert knobs.ttft_ms == 5.0 and isinstance(knobs.ttft_ms, float) and knobs.failure == "reset"


async def test_update_is_all_or_nothing() -> None:
    state = MockState(Knobs())
    with pytest.raises(ValueError):
        await state.update({"ttft_ms": 1, "failure": "bad"})
    assert state.knobs.ttft_ms == 50.0
    same = state.knobs
    await state.update({"ttft_ms": 1})
    assert state.knobs is same and same.ttft_ms == 1.0  # updated in place


@pytest.mark.parametrize(("text", "tokens"), [("", 0), ("a", 1), ("abcd", 1), ("abcde", 2)])
def test_estimate_tokens(text: str, tokens: int) -> None:
    assert estimate_tokens(text) == tokens


@pytest.mark.parametrize(("max_tokens", "n"), [(None, 16), (3, 3), (100, 16), (True, 16), (-1, 16)])
def test_completion_count(max_tokens: object, n: int) -> None:
    assert completion_count(Knobs(), max_tokens) == n


def test_stats_track_outcomes() -> None:
    stats = Stats()
    with stats.track("a"):
        pass
    with pytest.raises(asyncio.CancelledError), stats.track("a"):
        raise asyncio.CancelledError
    with pytest.raises(ConnectionResetError), stats.track("b"):
        raise ConnectionResetError
    with pytest.raises(RuntimeError), stats.track("b"):
        raise RuntimeError
    with stats.track("b") as call:
        call.fail()
    assert (stats.completed, stats.cancelled, stats.failed, stats.in_flight) == (1, 2, 2, 0)
    assert stats.requests == {"a": 2, "b": 3}
    for i in range(150):
        stats.seen.append(Seen.of([("x-request-id", str(i))]))
    assert len(stats.seen) == 100 and stats.seen[0].request_id == "50"


def test_seen_keeps_names_and_request_id_never_values() -> None:
    many = [(f"X-H{i}", "v") for i in range(300)]
    seen = Seen.of([("Authorization", "Bearer s3cr3t"), ("X-Request-Id", "r" * 500), *many])
    assert seen.request_id == "r" * 128
    assert len(seen.names) == 100 and "authorization" in seen.names
    assert "s3cr3t" not in repr(seen.as_dict())


@pytest.mark.parametrize(
    ("address", "expected"),
    [("127.0.0.1:80", ("127.0.0.1", 80)), ("[::1]:0", ("::1", 0)), ("h:65535", ("h", 65535))],
)
def test_split_host_port(address: str, expected: tuple[str, int]) -> None:
    assert split_host_port(address) == expected


@pytest.mark.parametrize("address", ["nohost", ":80", "h:x", "h:70000"])
def test_split_host_port_rejects(address: str) -> None:
    with pytest.raises(ValueError):
        split_host_port(address)


async def test_start_needs_an_address() -> None:
    with pytest.raises(ValueError):
        await start_mock_backend(None, None, Knobs())


@pytest.mark.parametrize("admin", ["0.0.0.0:0", "10.1.2.3:0", "[::]:0", "example.com:0"])
async def test_admin_listener_must_be_loopback(admin: str) -> None:
    with pytest.raises(ValueError, match="loopback"):
        await start_mock_backend("127.0.0.1:0", None, Knobs(), admin=admin)
    with pytest.raises(ValueError, match="loopback"):
        MockBackend(admin=admin)


@pytest.mark.parametrize("admin", ["127.0.0.1:0", "[::1]:0", "localhost:0"])
def test_policy_accepts_a_loopback_admin(admin: str) -> None:
    assert MockBackend(admin=admin).admin == admin


async def test_http_only_and_grpc_only() -> None:
    h = await start_mock_backend("127.0.0.1:0", None, Knobs())
    assert h.http_port and h.grpc_port is None
    await h.close()
    g = await start_mock_backend(None, "127.0.0.1:0", Knobs())
    assert g.grpc_port and g.http_port is None
    await g.close()


async def test_close_ends_hanging_calls_quickly() -> None:
    import aiohttp
    import grpc

    from gateway.proto import load

    pb2, pb2_grpc = load()
    handle = await start_mock_backend("127.0.0.1:0", "127.0.0.1:0", Knobs(failure="hang"))
    async with (
        aiohttp.ClientSession() as session,
        grpc.aio.insecure_channel(f"127.0.0.1:{handle.grpc_port}") as channel,
    ):
        url = f"http://127.0.0.1:{handle.http_port}/v1/completions"
        http_call = asyncio.create_task(session.post(url, json={"prompt": "p"}))
        grpc_call = pb2_grpc.InferenceStub(channel).Infer(pb2.InferRequest())
        while handle.stats.in_flight < 2:
            await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await handle.close()
        assert loop.time() - start < 3
        assert handle.stats.in_flight == 0 and handle.stats.cancelled == 2
        with pytest.raises(aiohttp.ClientError):
            await http_call
        with pytest.raises(grpc.aio.AioRpcError):
            await grpc_call
