"""RequestInfo: the frozen facts an adapter extracts from a request, the same for HTTP and gRPC."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field


class Protocol(enum.Enum):
    HTTP = "http"
    GRPC = "grpc"


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What the filter chain may decide on. Header names are lower-case.

    For gRPC `method` is "POST" and `path` is "/pkg.Service/Method"; `headers` holds the
    invocation metadata (text values only).
    """

    protocol: Protocol
    method: str
    path: str
    headers: Mapping[str, str] = field(default_factory=dict)
    peer: str = ""
    authority: str = ""
    content_length: int | None = None
