"""(compiled) RequestInfo: the frozen facts an adapter extracts from a request, the same for HTTP
and gRPC; and the rule a route's match applies to them (`first_route`)."""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Final, Protocol, TypeVar


class Wire(enum.Enum):
    """The wire a request came in on: the HTTP listener or the gRPC one."""

    HTTP = "http"
    GRPC = "grpc"


_NO_HEADERS: Final[Mapping[str, str]] = MappingProxyType({})


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


class RouteMatch(Protocol):
    """A route's `match` as the policy compiled it (`gateway.policy.compiled.CompiledRoute`)."""

    protocol: Wire | None  # None: any listener
    path_prefix: str
    methods: frozenset[str]  # empty: any method
    headers: tuple[tuple[str, str | None], ...]  # (lower-case name, value or None: present)
    model_re: re.Pattern[str] | None  # `match.model` globs as one pattern


R = TypeVar("R", bound=RouteMatch)


def route_matches(r: RouteMatch, info: RequestInfo) -> bool:
    """The route's protocol, path prefix, methods and headers match the request."""
    if r.protocol is not None and info.protocol is not r.protocol:
        return False
    if not info.path.startswith(r.path_prefix):
        return False
    if r.methods and info.method not in r.methods:
        return False
    for name, value in r.headers:
        got = info.headers.get(name)
        if got is None or (value is not None and got != value):
            return False
    return True


def first_route(
    routes: Sequence[R], info: RequestInfo, model: str | None = None, by_model: bool = True
) -> R | None:
    """The first route that matches (policy order). With `by_model`, a route with `match.model`
    matches only a `model` one of its globs matches (a request without a model never takes
    it); without, `match.model` is not looked at (the route is decided after the body)."""
    for r in routes:
        if route_matches(r, info):
            mr = r.model_re
            if by_model and mr is not None and (model is None or mr.match(model) is None):
                continue
            return r
    return None
