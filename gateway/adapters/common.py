"""(compiled) What every HTTP engine writes alike: the cached Date value, the reason phrases and the
size under which a complete answer may wait for the loop turn's batch."""

from __future__ import annotations

import time
from email.utils import formatdate
from http import HTTPStatus
from typing import Final

DEFER_MAX = 65536  # answers under this size may wait for the loop turn's batch (`OutBatch`)
REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_date: Final[list[object]] = [0, b""]


def date_value() -> bytes:
    """The Date header value, formatted once per second."""
    now = int(time.time())
    if _date[0] != now:
        _date[0], _date[1] = now, formatdate(now, usegmt=True).encode()
    value = _date[1]
    assert isinstance(value, bytes)
    return value
