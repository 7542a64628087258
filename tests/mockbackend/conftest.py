"""Fixtures: a mock backend on port 0 (fast knobs), an aiohttp session and a gRPC channel to it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest

from gateway.mockbackend import Knobs, MockBackendHandle, start_mock_backend


@pytest.fixture
async def backend() -> AsyncIterator[MockBackendHandle]:
    knobs = Knobs(ttft_ms=0, token_delay_ms=0, completion_tokens=4)
    handle = await start_mock_backend("127.0.0.1:0", "127.0.0.1:0", knobs, admin="127.0.0.1:0")
    yield handle
    await handle.close()


@pytest.fixture
async def http(backend: MockBackendHandle) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(f"http://127.0.0.1:{backend.http_port}") as session:
        yield session


@pytest.fixture
async def admin(backend: MockBackendHandle) -> AsyncIterator[aiohttp.ClientSession]:
    """A session to the backend's admin listener (knobs, stats, reset)."""
    async with aiohttp.ClientSession(f"http://127.0.0.1:{backend.admin_port}") as session:
        yield session


@pytest.fixture
async def channel(backend: MockBackendHandle) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{backend.grpc_port}") as ch:
        yield ch
