"""Model discovery: what each member of a backend with `models.discover` serves, read from its
`GET /v1/models` on a timer and whenever its health changes, kept in the services (`MODELS`),
so that a reload finds every member's last listing where it was.

- One `ListingBox` per backend, member (address and TLS settings) and `models` section: the
  last listing that parsed, when, and the error of the last one that did not. A listing that
  fails (refused, timeout, not a model list) keeps the last known models: a member busy
  restarting must not lose its traffic for it (its health check decides that).
- `ModelsView`: one backend section's view of its members' boxes, and the `ModelIndex`
  (`gateway.core.models`) the router asks, rebuilt when a listing changed (`epoch`).
- Each listing is one HTTP/1.1 request on a connection of its own (`Connection: close`), read
  up to `MAX_LISTING_BYTES` within `models.timeout_s`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from typing import TYPE_CHECKING, Any, Final

import httptools

from gateway.core.models import Listing, ModelIndex, parse_listing
from gateway.services import ServiceKey
from gateway.telemetry import metrics

if TYPE_CHECKING:
    from gateway.policy.compiled import Endpoint
    from gateway.policy.llm import Models
    from gateway.policy.model import Backend
    from gateway.services import Services

log = logging.getLogger("sluice.models")

MAX_LISTING_BYTES = 4 << 20
MAX_PARENTS = 4096  # adapters remembered with their parent, per backend section


class ListingBox:
    """One member's model listing and the loop that reads it."""

    __slots__ = ("backend", "ep", "cfg", "listing", "error", "task", "poke", "healthy", "reads")

    def __init__(self, backend: str, ep: Endpoint, cfg: Models) -> None:
        self.backend = backend
        self.ep = ep
        self.cfg = cfg
        self.listing: Listing | None = None  # None: never listed
        self.error = ""
        self.task: asyncio.Task[None] | None = None
        self.poke: asyncio.Event | None = None
        self.healthy: bool | None = None  # last health seen (a change pokes the loop)
        self.reads = 0

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None
            self.poke = None

    def snapshot(self) -> dict[str, object]:
        ls = self.listing
        return {
            "models": sorted(ls.bases) if ls else [],
            "adapters": dict(sorted(ls.adapters.items())) if ls else {},
            "error": self.error,
            "reads": self.reads,
        }


async def fetch_json(ep: Endpoint, path: str, timeout: float) -> tuple[Any, str]:
    """`GET path` on the member: (parsed JSON or None, error text)."""
    status = 0
    body: list[bytes] = []
    size = 0
    done = False

    class Sink:
        def on_body(self, data: bytes) -> None:
            nonlocal size
            size += len(data)
            if size <= MAX_LISTING_BYTES:
                body.append(data)

        def on_message_complete(self) -> None:
            nonlocal done
            done = True

    parser = httptools.HttpResponseParser(Sink())
    writer = None
    host, port, tls = ep.host, ep.port, ep.tls
    try:
        async with asyncio.timeout(timeout):
            if tls is None:
                reader, writer = await asyncio.open_connection(host, port)
            else:
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=tls.context, server_hostname=tls.server_hostname(host)
                )
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: {ep.address}\r\nUser-Agent: sluice-models\r\n"
                "Accept: application/json\r\nConnection: close\r\n\r\n".encode("latin-1")
            )
            await writer.drain()
            while not done and size <= MAX_LISTING_BYTES:
                data = await reader.read(65536)
                if not data:
                    break
                parser.feed_data(data)
            status = parser.get_status_code()
    except TimeoutError:
        return None, f"timeout after {timeout:g}s"
    except ssl.SSLError as e:
        return None, f"TLS {e.reason or e}"
    except (OSError, httptools.HttpParserError) as e:
        return None, f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            writer.close()
    if size > MAX_LISTING_BYTES:
        return None, f"listing larger than {MAX_LISTING_BYTES} bytes"
    if not done or status != 200:
        return None, f"status {status}" if status else "incomplete answer"
    try:
        return json.loads(b"".join(body)), ""
    except ValueError:
        return None, "not JSON"


class ModelBook:
    """The services' owner of every member's model listing (key "models")."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.boxes: dict[tuple[str, str, str], ListingBox] = {}
        self.epoch = 0  # counts listing and membership changes: indexes rebuild when it moves

    def box(self, backend: str, ep: Endpoint, cfg: Models) -> ListingBox:
        key = (backend, ep.upstream_key, cfg.model_dump_json())
        b = self.boxes.get(key)
        if b is None:
            b = self.boxes[key] = ListingBox(backend, ep, cfg)
        return b

    def start(self, box: ListingBox) -> None:
        if box.task is None:
            box.poke = asyncio.Event()
            box.task = self.services.spawn(
                self._loop(box), f"models:{box.backend}:{box.ep.address}"
            )

    async def read(self, box: ListingBox) -> None:
        """One listing of the member (the loop's step; tests call it too)."""
        cfg = box.cfg
        doc, err = await fetch_json(box.ep, cfg.path, cfg.timeout_s)
        listing = parse_listing(doc, cfg.max_models) if doc is not None else None
        box.reads += 1
        if listing is None:
            box.error = err or "not a model list"
            metrics.MODEL_LISTINGS.labels(box.backend, "error").inc()
            log.info("models: backend=%s member=%s listing failed (%s); last known kept",
                     box.backend, box.ep.address, box.error)  # fmt: skip
            return
        metrics.MODEL_LISTINGS.labels(box.backend, "ok").inc()
        box.error = ""
        if listing != box.listing:
            box.listing = listing
            self.epoch += 1
            log.info("models: backend=%s member=%s serves %d models, %d adapters", box.backend,
                     box.ep.address, len(listing.bases), len(listing.adapters))  # fmt: skip

    async def _loop(self, box: ListingBox) -> None:
        interval = box.cfg.interval_s
        while True:
            await self.read(box)
            poke = box.poke
            if poke is None:
                return
            poke.clear()
            try:
                async with asyncio.timeout(interval):
                    await poke.wait()
            except TimeoutError:
                pass

    def forget(self, held: set[int], working: set[int]) -> None:
        """Stop the loops no working view holds; drop the boxes no view holds."""
        for k, b in list(self.boxes.items()):
            if id(b) not in working:
                b.stop()
            if id(b) not in held:
                del self.boxes[k]

    def aclose(self) -> None:
        for b in self.boxes.values():
            b.stop()


MODELS: Final = ServiceKey[ModelBook]("models")  # every member's model listing


class ModelsView:
    """One backend section's models: its static names, its members' listings, the index."""

    __slots__ = ("book", "cfg", "boxes", "parents", "_index", "_epoch")

    def __init__(self, book: ModelBook, cfg: Backend) -> None:
        assert cfg.models is not None
        self.book = book
        self.cfg = cfg
        self.boxes: dict[str, ListingBox] = {}
        # Adapters listed once (with their parent): an adapter a member unloaded can still be
        # sent to its parent's members (models.lora: load_on_demand). Bounded.
        self.parents: dict[str, str] = {}
        self._index: ModelIndex | None = None
        self._epoch = -1

    def track(self, ep: Endpoint) -> None:
        m = self.cfg.models
        if m is not None and m.discover:
            self.boxes[ep.address] = self.book.box(self.cfg.name, ep, m)
            self.book.epoch += 1

    def forget(self, address: str) -> None:
        if self.boxes.pop(address, None) is not None:
            self.book.epoch += 1

    def start(self) -> None:
        for b in self.boxes.values():
            self.book.start(b)

    def health(self, address: str, healthy: bool) -> None:
        """The member's health as the plan sees it: a change lists its models again."""
        b = self.boxes.get(address)
        if b is None or b.healthy is healthy:
            return
        first = b.healthy is None
        b.healthy = healthy
        if not first and b.poke is not None:
            b.poke.set()

    def index(self) -> ModelIndex:
        ix = self._index
        if ix is None or self._epoch != self.book.epoch:
            m = self.cfg.models
            assert m is not None
            listings = {a: b.listing for a, b in self.boxes.items() if b.listing is not None}
            ix = ModelIndex(m.names, listings, m.lora == "load_on_demand", self.parents)
            if len(ix.parents) <= MAX_PARENTS:
                self.parents = dict(ix.parents)
            self._index = ix
            self._epoch = self.book.epoch
        return ix

    def state(self) -> dict[str, object]:
        m = self.cfg.models
        assert m is not None
        return {
            "names": list(m.names),
            "lora": m.lora,
            "members": {a: b.snapshot() for a, b in self.boxes.items()},
        }


def models_view(services: Services, cfg: Backend) -> ModelsView | None:
    if cfg.models is None:
        return None
    return ModelsView(services.get(MODELS, lambda: ModelBook(services)), cfg)
