"""Fixtures shared by the HTTP ingress tests."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["aiohttp", "native"])
def engine(request: pytest.FixtureRequest) -> str:
    """The HTTP engine under test: every ingress test runs against both."""
    return str(request.param)
