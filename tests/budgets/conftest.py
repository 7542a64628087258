from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_support import RedisServer, serve_redis


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A private redis-server per test."""
    yield from serve_redis(Path(tmp_path_factory.mktemp("redis")))
