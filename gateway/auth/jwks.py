"""JWKS caches: one `JwksSource` per key-set location (file or URL), owned by `JwksCaches`, the
services' "jwks" owner, so that the key sets outlive policy reloads.

A source is fetched in the background: at start, then every `cache_s` (stale-while-revalidate:
requests keep using the set in force while it is refetched); a failed fetch is retried with
jittered exponential backoff and leaves the last good set in force until `max_stale_s` after it
was fetched, then the set is dropped and the provider's tokens fail (closed; never a built-in
key). A token whose `kid` is not in the set makes at most one refetch per
`unknown_kid_cooldown_s`; all requests that need keys wait on the one fetch in flight
(single-flight), bounded by its timeout. A fetch has a hard deadline, a size cap, refuses
redirects, HTML and anything `gateway.auth.keys.parse_jwks` refuses.

Reloads: a source is keyed by its location. A new policy naming the same file or URL finds its
source as it was (keys, age, backoff: no refetch); changed cache parameters take effect from the
next scheduled fetch. A source no longer named by the policy that goes live is closed (its loop
stops) at activation. Building a policy never waits on a fetch.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from gateway.auth.keys import KeySet, parse_jwks
from gateway.core import keyrefresh as kr
from gateway.errors import JwksError, JwksInvalid
from gateway.policy.auth import JwksSource as JwksSpec
from gateway.services import ServiceKey
from gateway.telemetry import edge_metrics

if TYPE_CHECKING:
    import aiohttp

    from gateway.services import Services

log = logging.getLogger("sluice.jwks")

SourceKey = tuple[str, str]  # ("file" | "url", location)


def source_key(spec: JwksSpec) -> SourceKey:
    return ("file", str(spec.file)) if spec.file is not None else ("url", str(spec.url))


def _params(spec: JwksSpec) -> kr.RefreshParams:
    return kr.RefreshParams(spec.cache_s, spec.max_stale_s, spec.unknown_kid_cooldown_s)


def _read_file(path: str, limit: int) -> bytes:
    try:
        with Path(path).open("rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise JwksError("unreadable", e.strerror or type(e).__name__) from None
    if len(raw) > limit:
        raise JwksInvalid(f"more than {limit} bytes", "too_large")
    return raw


class JwksSource:
    """One key set, its schedule and its health. `current()` is what requests read."""

    def __init__(self, owner: JwksCaches, key: SourceKey, label: str, spec: JwksSpec) -> None:
        self._owner = owner
        self.key = key
        self.label = label
        self.spec = spec
        self.params = _params(spec)
        self.keyset: KeySet | None = None
        self.generation = 0  # bumped when a key is removed or changed, or the set dropped
        self.fetched_at: float | None = None  # monotonic, last good fetch
        self.fetched_wall: float | None = None
        self.failures = 0  # in a row
        self.fetches = 0  # attempts since start
        self.last_error = ""
        self.last_error_wall: float | None = None
        self.next_at = 0.0  # monotonic: when the loop fetches next
        self.last_miss_fetch: float | None = None
        self.closed = False
        self._inflight: asyncio.Task[None] | None = None
        self._loop: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None

    def configure(self, label: str, spec: JwksSpec) -> None:
        """New policy parameters for the same location (no I/O, keeps the set)."""
        self.label = label
        if spec != self.spec:
            self.spec, self.params = spec, _params(spec)
            if self.fetched_at is not None and self.failures == 0:
                self.next_at = kr.after_success(self.params, self.fetched_at, self._owner.rand())
            if self._wake is not None:
                self._wake.set()

    # --- what requests use (plain calls) -------------------------------------------------
    def current(self) -> KeySet | None:
        """The set in force, or None (never loaded, or older than max_stale: dropped)."""
        ks = self.keyset
        if ks is not None and not kr.usable(self.params, self.fetched_at, self._owner.clock()):
            log.error("JWKS %s: last good key set is older than max_stale_s; dropped", self.label)
            self.keyset, ks = None, None
            self.generation += 1
            edge_metrics.JWKS_KEYS.labels(self.label).set(0)
        return ks

    def fetch_to_wait_for(self) -> asyncio.Task[None] | None:
        """For a request that found no key: the fetch in flight, or a new one if the unknown-kid
        cooldown allows it; None when the request must be decided without new keys."""
        if self.closed:
            return None
        self.start()
        task = self._inflight
        if task is not None and not task.done():
            return task
        now = self._owner.clock()
        if not kr.miss_may_fetch(self.params, self.last_miss_fetch, now):
            return None
        self.last_miss_fetch = now
        return self._fetch_now()

    def valid_until_wall(self) -> float:
        """Wall-clock time after which the set in force is dropped (a verified token cached
        with one of its keys must not outlive it)."""
        if self.fetched_wall is None:
            return 0.0
        return self.fetched_wall + self.params.max_stale

    # --- background ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the refresh loop (needs a running loop; a no-op when running or closed)."""
        if self.closed or (self._loop is not None and not self._loop.done()):
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # started by the first request or activation inside the loop
        self._wake = asyncio.Event()
        self._loop = self._owner.spawn(self._run(), f"jwks:{self.label}")

    def close(self) -> None:
        self.closed = True
        for t in (self._loop, self._inflight):
            if t is not None and not t.done():
                t.cancel()

    async def _run(self) -> None:
        wake = self._wake
        assert wake is not None
        while not self.closed:
            delay = self.next_at - self._owner.clock()
            if delay > 0:
                wake.clear()
                try:
                    await asyncio.wait_for(wake.wait(), delay)
                except TimeoutError:
                    pass
                continue
            await asyncio.shield(self._fetch_now())

    def _fetch_now(self) -> asyncio.Task[None]:
        task = self._inflight
        if task is None or task.done():
            task = self._inflight = self._owner.spawn(self._fetch(), f"jwks-fetch:{self.label}")
        return task

    async def _fetch(self) -> None:
        self.fetches += 1
        try:
            raw = await self._owner.read(self.spec)
            ks = parse_jwks(raw, self.keyset)
        except JwksError as e:
            self._failed(e.kind, e.reason)
        except Exception:  # a bug here must never take the last good set away
            log.exception("JWKS %s: fetch failed", self.label)
            self._failed("internal_error", "internal_error")
        else:
            self._succeeded(ks)
        if self._wake is not None:
            self._wake.set()

    def _succeeded(self, ks: KeySet) -> None:
        owner = self._owner
        old = self.keyset
        changed = old is None or old.fingerprint != ks.fingerprint
        if old is not None and not old.thumbs <= ks.thumbs:
            self.generation += 1  # a key went away or changed: its cached tokens go too
        if changed:
            self.keyset = ks
            log.info("JWKS %s: %d keys in force (%s)", self.label, len(ks), ks.fingerprint)
        self.fetched_at, self.fetched_wall = owner.clock(), owner.wall()
        self.failures = 0
        self.next_at = kr.after_success(self.params, self.fetched_at, owner.rand())
        edge_metrics.JWKS_FETCHES.labels(self.label, "ok" if changed else "unchanged").inc()
        edge_metrics.JWKS_KEYS.labels(self.label).set(len(self.keyset or ()))
        edge_metrics.JWKS_LAST_SUCCESS.labels(self.label).set(self.fetched_wall)

    def _failed(self, kind: str, reason: str) -> None:
        owner = self._owner
        self.failures += 1
        self.last_error, self.last_error_wall = reason, owner.wall()
        self.next_at = kr.after_failure(self.params, owner.clock(), self.failures, owner.rand())
        edge_metrics.JWKS_FETCHES.labels(self.label, kind).inc()
        log.warning(
            "JWKS %s: fetch failed (%s, %d in a row); %s",
            self.label,
            reason,
            self.failures,
            "keeping the last good set" if self.keyset is not None else "no key set yet",
        )

    def readiness(self) -> dict[str, Any]:
        now, wall = self._owner.clock(), self._owner.wall()
        ks = self.keyset
        return {
            "source": f"{self.key[0]}:{self.key[1]}",
            "keys": len(ks) if ks is not None else 0,
            "usable": ks is not None and kr.usable(self.params, self.fetched_at, now),
            "age_s": None if self.fetched_at is None else round(now - self.fetched_at, 1),
            "fetches": self.fetches,
            "failures_in_a_row": self.failures,
            "last_error": self.last_error or None,
            "last_error_age_s": None
            if self.last_error_wall is None
            else round(wall - self.last_error_wall, 1),
            "next_fetch_in_s": round(max(0.0, self.next_at - now), 1),
        }


class JwksCaches:
    """The "jwks" services owner: every key-set source, and the HTTP session they share."""

    def __init__(
        self,
        services: Services,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self._services = services
        self.clock, self.wall = clock, wall
        self.rand = (rng or random.Random()).random
        self.sources: dict[SourceKey, JwksSource] = {}
        self._session: aiohttp.ClientSession | None = None

    def source(self, label: str, spec: JwksSpec) -> JwksSource:
        """The source for `spec`'s location, created if new (no I/O). An existing one keeps its
        parameters until `activate`: a policy that is built but never goes live changes nothing."""
        key = source_key(spec)
        src = self.sources.get(key)
        if src is None or src.closed:
            src = self.sources[key] = JwksSource(self, key, label, spec)
        return src

    def activate(self, used: Iterable[tuple[JwksSource, str, JwksSpec]]) -> None:
        """The policy naming `used` (source, provider, parameters) went live: configure and
        start those, close the others."""
        used = list(used)
        keep = {src.key for src, _, _ in used}
        for key in [k for k in self.sources if k not in keep]:
            self.sources.pop(key).close()
        for src, label, spec in used:
            src.configure(label, spec)
            src.start()

    def spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        return self._services.spawn(coro, name)

    async def read(self, spec: JwksSpec) -> bytes:
        """The document's bytes, within `timeout_s` and `max_bytes`, or JwksError."""
        try:
            async with asyncio.timeout(spec.timeout_s):
                if spec.file is not None:
                    return await asyncio.to_thread(_read_file, spec.file, spec.max_bytes)
                assert spec.url is not None
                return await self._get(spec.url, spec.max_bytes)
        except TimeoutError:
            raise JwksError("timeout", f"no answer within {spec.timeout_s:g} s") from None

    async def _get(self, url: str, limit: int) -> bytes:
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=16, ttl_dns_cache=60),
                trust_env=False,  # no proxy from the environment: keys come from where we said
                auto_decompress=False,  # asked for identity; a compressed body is not JSON
            )
        headers = {
            "accept": "application/jwk-set+json, application/json",
            "accept-encoding": "identity",
        }
        try:
            async with self._session.get(url, allow_redirects=False, headers=headers) as r:
                if r.status != 200:
                    raise JwksError("http_error", f"HTTP {r.status}")
                ctype = r.content_type.lower()
                if "html" in ctype or "xml" in ctype:
                    raise JwksInvalid(f"content type {ctype[:60]}")
                if r.content_length is not None and r.content_length > limit:
                    raise JwksInvalid(f"more than {limit} bytes", "too_large")
                body = bytearray()
                async for chunk in r.content.iter_chunked(65536):
                    body += chunk
                    if len(body) > limit:
                        raise JwksInvalid(f"more than {limit} bytes", "too_large")
                return bytes(body)
        except aiohttp.ClientError as e:
            raise JwksError("unreachable", type(e).__name__) from None

    def readiness(self) -> dict[str, Any]:
        """`/readyz` detail: per provider, the key set's age, size and last error."""
        return {s.label: s.readiness() for s in self.sources.values()}

    def state(self) -> dict[str, Any]:
        return self.readiness()

    async def aclose(self) -> None:
        for s in self.sources.values():
            s.close()
        if self._session is not None:
            await self._session.close()


JWKS: Final = ServiceKey[JwksCaches]("jwks")  # the JWKS sources of every provider
