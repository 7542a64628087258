from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from gateway.services import Services
from tests.redis_support import RedisServer


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def services() -> AsyncIterator[Services]:
    """Closed whatever the test does: its Redis clients and background loops end with it."""
    s = Services()
    try:
        yield s
    finally:
        await s.aclose()
