"""(compiled) RequestInfo: the frozen facts an adapter extracts from a request, the same for HTTP
and gRPC."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType


class Wire(enum.Enum):
    """The wire a request came in on: the HTTP listener or the gRPC one."""

    HTTP = "http"
    GRPC = "grpc"


_NO_HEADERS: Mapping[str, str] = MappingProxyType({})


class RequestInfo:
    """What the filter chain may decide on. Header names are lower-case.

    For gRPC `method` is "POST" and `path` is "/pkg.Service/Method"; `headers` holds the
    invocation metadata (text values only). Set once, by the adapter that read the request, and
    never changed after. A plain compiled class: built and read without a Python frame (a named
    tuple's `__new__` runs interpreted, and its fields are descriptor reads).
    """

    __slots__ = ("protocol", "method", "path", "headers", "peer", "authority",
                 "content_length", "client_cert")  # fmt: skip

    def __init__(
        self,
        protocol: Wire,
        method: str,
        path: str,
        headers: Mapping[str, str] = _NO_HEADERS,
        peer: str = "",
        authority: str = "",
        content_length: int | None = None,
        # The verified client certificate's identity (mTLS: first URI SAN, else first DNS SAN,
        # else subject CN); "" for a plaintext connection or a client without a certificate.
        client_cert: str = "",
    ) -> None:
        self.protocol = protocol
        self.method = method
        self.path = path
        self.headers = headers
        self.peer = peer
        self.authority = authority
        self.content_length = content_length
        self.client_cert = client_cert

    def __repr__(self) -> str:
        return (
            f"RequestInfo({self.protocol.value} {self.method} {self.path!r}, peer={self.peer!r}, "
            f"authority={self.authority!r}, content_length={self.content_length})"
        )


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
