"""(compiled) RequestInfo: the frozen facts an adapter extracts from a request, the same for HTTP
and gRPC."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple


class Wire(enum.Enum):
    """The wire a request came in on: the HTTP listener or the gRPC one."""

    HTTP = "http"
    GRPC = "grpc"


_NO_HEADERS: Mapping[str, str] = MappingProxyType({})


class RequestInfo(NamedTuple):
    """What the filter chain may decide on. Header names are lower-case.

    For gRPC `method` is "POST" and `path` is "/pkg.Service/Method"; `headers` holds the
    invocation metadata (text values only). A named tuple (immutable, built in ~0.2 µs; a
    frozen dataclass sets each field through `object.__setattr__`).
    """

    protocol: Wire
    method: str
    path: str
    headers: Mapping[str, str] = _NO_HEADERS
    peer: str = ""
    authority: str = ""
    content_length: int | None = None
    # The verified client certificate's identity (mTLS: first URI SAN, else first DNS SAN, else
    # subject CN); "" for a plaintext connection or a client without a certificate.
    client_cert: str = ""


def unsafe_path(path: str) -> bool:
    """True for a request path that backends may resolve differently than the route matched it:
    dot segments (`/v1/../admin`), encoded dots, slashes or backslashes (`%2e`, `%2f`, `%5c`),
    encoded NUL, or a raw backslash. Such paths are refused rather than normalised, because the
    gateway forwards the raw path and must not match one path and deliver another."""
    if "%" in path:
        low = path.lower()
        if "%2e" in low or "%2f" in low or "%5c" in low or "%00" in low:
            return True
    if "\\" in path:
        return True
    if "/." in path:
        for segment in path.split("/"):
            if segment == "." or segment == "..":
                return True
    return False
