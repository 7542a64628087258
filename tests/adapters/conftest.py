"""Fixtures shared by the HTTP ingress tests."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["aiohttp", "native"])
def engine(request: pytest.FixtureRequest) -> str:
    """The HTTP engine under test: every ingress test runs against both."""
    return str(request.param)


@pytest.fixture(params=["grpcio", "h2"])
def grpc_engine(request: pytest.FixtureRequest) -> str:
    """The gRPC engine under test (`listeners.grpc.engine`): the gRPC tests run against both."""
    return str(request.param)
