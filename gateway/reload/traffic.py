"""(compiled) TrafficBook: what the recent traffic looked like, for the change guard. A services
owner (`services.get(TRAFFIC, TrafficBook)`), fed once per finished request by
`gateway.forward.lifecycle.Lifecycle.finish`.

Requests are counted by *shape*: protocol, method, path, the values of the headers the running
policy's routes match on, and the route and backend that served it. Per shape it keeps a count,
a histogram of the request body size (the larger of the bytes read and the declared
Content-Length, so a request refused before its body was read still counts its size), and, for
requests that got an answer from a backend (`ctx.first_byte_at` set by the forwarding path),
a histogram of the time to that first byte and one of the whole duration. A request Sluice
refused, or whose backend never answered, tells nothing about the backend's latency: it is
counted, its latency is not. That is what the guard needs to replay the traffic through a new
policy: which route would match, whether that route has a usable endpoint, and how many
requests a smaller body limit or a shorter timeout would refuse.

Cost per request: a `_monotonic()`, a tuple, a dict lookup and three list increments (see
`tests/bench/bench_traffic.py`). Memory is bounded: `MAX_SHAPES` per one-minute bucket and
`BUCKETS` buckets (the window is the last 4 to 5 minutes). Beyond the cap, a new path is
recorded under its route's path prefix (the guard then replays the prefix, an approximation
it reports); past `MAX_APPROXIMATE` of those too (methods and matched header values are the
client's, so they could still vary without end), a request is counted in the first
approximate shape of its protocol, route and backend (names from the policy). Values of
credential headers (authorization, cookie, ...) are never stored: a route matching on one sees
"<redacted>".

On a policy change the book keeps its counts (they describe traffic, not policy) and learns the
header names of the new routes (`configure`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from gateway.core.histogram import (
    latency_bucket,
    merge,
    new_latency_hist,
    new_size_hist,
    size_bucket,
)
from gateway.core.request import RequestInfo, Wire
from gateway.services import ServiceKey

if TYPE_CHECKING:
    from gateway.context import RequestContext
    from gateway.policy.compiled import CompiledPolicy

_monotonic: Final = time.monotonic  # a static: no module attribute lookup per call

BUCKET_S: Final = 60.0
BUCKETS: Final = 5
MAX_SHAPES: Final = 512
MAX_APPROXIMATE: Final = 512  # shapes kept by path prefix, beyond MAX_SHAPES, per bucket
SECRET_HEADERS: Final = frozenset(
    {"authorization", "cookie", "proxy-authorization", "x-api-key", "api-key"}
)
REDACTED: Final = "<redacted>"

# By the member's id: an enum's `.value` is two Python-level calls per read.
_PROTOCOL: Final = {id(p): p.value for p in Wire}

# (protocol, method, path, header values, route, backend)
ShapeKey = tuple[str, str, str, tuple[tuple[str, str | None], ...], str, str]


@dataclass(slots=True)
class ShapeStats:
    count: int = 0
    first_byte: list[int] = field(default_factory=new_latency_hist)
    duration: list[int] = field(default_factory=new_latency_hist)
    body: list[int] = field(default_factory=new_size_hist)
    approximate: bool = False  # recorded under the route's prefix (the shape table was full)


@dataclass(frozen=True, slots=True)
class Shape:
    """One kind of request and what was seen of it in the window."""

    protocol: str
    method: str
    path: str
    headers: tuple[tuple[str, str | None], ...]
    route: str  # "" = no route matched under the policy of the time
    backend: str
    stats: ShapeStats

    @property
    def request_key(self) -> tuple[str, str, str, tuple[tuple[str, str | None], ...]]:
        """What identifies the request itself, whichever route served it."""
        return self.protocol, self.method, self.path, self.headers

    def info(self) -> RequestInfo:
        """A request of this shape, to replay through a policy's route matcher."""
        hdrs = {k: v for k, v in self.headers if v is not None}
        return RequestInfo(Wire(self.protocol), self.method, self.path, hdrs)

    def as_json(self) -> dict[str, Any]:
        s = self.stats
        return {
            "protocol": self.protocol,
            "method": self.method,
            "path": self.path,
            "headers": [list(h) for h in self.headers],
            "route": self.route,
            "backend": self.backend,
            "count": s.count,
            "first_byte": s.first_byte,
            "duration": s.duration,
            "body": s.body,
            "approximate": s.approximate,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Shape:
        stats = ShapeStats(
            int(d["count"]),
            [int(x) for x in d["first_byte"]],
            [int(x) for x in d["duration"]],
            [int(x) for x in d["body"]],
            bool(d.get("approximate", False)),
        )
        headers = tuple((str(k), None if v is None else str(v)) for k, v in d["headers"])
        return cls(
            str(d["protocol"]),
            str(d["method"]),
            str(d["path"]),
            headers,
            str(d["route"]),
            str(d["backend"]),
            stats,
        )


@dataclass(frozen=True, slots=True)
class TrafficSnapshot:
    window_s: float
    shapes: tuple[Shape, ...]

    @property
    def total(self) -> int:
        return sum((s.stats.count for s in self.shapes), 0)

    def as_json(self) -> dict[str, Any]:
        return {"window_s": self.window_s, "shapes": [s.as_json() for s in self.shapes]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrafficSnapshot:
        return cls(float(d["window_s"]), tuple(Shape.from_json(s) for s in d["shapes"]))


class TrafficBook:
    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._cur: dict[ShapeKey, ShapeStats] = {}
        self._cur_start = now()
        self._cur_end = self._cur_start + BUCKET_S
        self._old: deque[tuple[float, dict[ShapeKey, ShapeStats]]] = deque(maxlen=BUCKETS - 1)
        # The first approximate shape of each (protocol, route, backend) in the current bucket.
        self._folded: dict[tuple[str, str, str], ShapeStats] = {}
        self._match_headers: tuple[str, ...] = ()

    def configure(self, policy: CompiledPolicy) -> None:
        """Learn which header values identify a request's route under `policy`."""
        names = {name for r in policy.routes for name, _ in r.headers}
        self._match_headers = tuple(sorted(names))

    def record(self, ctx: RequestContext) -> None:
        now = self._now()
        if now >= self._cur_end:
            self._rotate(now)
        info = ctx.info
        route = ctx.route
        endpoint = ctx.endpoint
        mh = self._match_headers
        hdrs = self._header_values(info, mh) if mh else ()
        key = (
            _PROTOCOL[id(info.protocol)],
            info.method,
            info.path,
            hdrs,
            route.name if route is not None else "",
            endpoint.backend if endpoint is not None else "",
        )
        st = self._cur.get(key)
        if st is None:
            st = self._new_shape(key, ctx)
        st.count += 1
        fb = ctx.first_byte_at
        if fb is not None:
            st.first_byte[latency_bucket(fb - ctx.started)] += 1
            st.duration[latency_bucket(now - ctx.started)] += 1
        cl = info.content_length
        n = ctx.bytes_in
        st.body[size_bucket(cl if cl is not None and cl > n else n)] += 1

    @staticmethod
    def _header_values(
        info: RequestInfo, names: Iterable[str]
    ) -> tuple[tuple[str, str | None], ...]:
        out = []
        for n in names:
            v = info.headers.get(n)
            if v is not None and n in SECRET_HEADERS:
                v = REDACTED
            out.append((n, v))
        return tuple(out)

    def _new_shape(self, key: ShapeKey, ctx: RequestContext) -> ShapeStats:
        cur = self._cur
        if len(cur) < MAX_SHAPES:
            new = cur[key] = ShapeStats()
            return new
        prefix = ctx.route.path_prefix if ctx.route is not None else "/"
        approx_key = (key[0], key[1], prefix, key[3], key[4], key[5])
        st = cur.get(approx_key)
        if st is not None:
            return st
        kept = (key[0], key[4], key[5])
        folded = self._folded.get(kept)
        if folded is not None and len(cur) >= MAX_SHAPES + MAX_APPROXIMATE:
            return folded
        st = cur[approx_key] = ShapeStats(approximate=True)
        if folded is None:
            self._folded[kept] = st
        return st

    def _rotate(self, now: float) -> None:
        if self._cur:
            self._old.append((self._cur_start, self._cur))
        self._cur = {}
        self._folded = {}
        self._cur_start = now
        self._cur_end = now + BUCKET_S

    def snapshot(self) -> TrafficSnapshot:
        """The shapes of the last `BUCKETS` minutes, merged."""
        now = self._now()
        oldest = now - BUCKET_S * BUCKETS
        merged: dict[ShapeKey, ShapeStats] = {}
        buckets = [b for start, b in self._old if start >= oldest] + [self._cur]
        for bucket in buckets:
            for key, st in bucket.items():
                m = merged.get(key)
                if m is None:
                    m = merged[key] = ShapeStats(approximate=st.approximate)
                m.count += st.count
                merge(m.first_byte, st.first_byte)
                merge(m.duration, st.duration)
                merge(m.body, st.body)
        starts = [start for start, _ in self._old if start >= oldest] + [self._cur_start]
        window = now - min(starts)
        shapes = tuple(
            Shape(k[0], k[1], k[2], k[3], k[4], k[5], st)
            for k, st in sorted(merged.items(), key=lambda kv: -kv[1].count)
        )
        return TrafficSnapshot(round(window, 3), shapes)

    def state(self) -> dict[str, Any]:
        snap = self.snapshot()
        return {"window_s": snap.window_s, "requests": snap.total, "shapes": len(snap.shapes)}


TRAFFIC: Final = ServiceKey[TrafficBook]("traffic")  # recent traffic, for the guard
