"""TLS termination on a listener: one owner per listener (`tls.http`, `tls.grpc` in the services)
holds the context it serves and keeps it current with its files.

Rotation without a restart: the owner polls the files' stat (device, inode, mtime, size) every
`tls_watch_interval_s` (2 s). A change is loaded once it has held still for one poll (a writer
that replaces the certificate and then the key is seen as one change): the new context is built
here, outside any handshake, and swapped in whole. The listener keeps its first context; from the
first rotation on, that context's `sni_callback` (run for every handshake, SNI or not) points the
connection at the current one (`ssl_object.context = current`): new connections get the new
certificate, open ones keep what they negotiated. Until a rotation there is no callback: it would
be a call into Python (taking the GIL back) in every handshake for nothing. Every context is built
by the same function, so ALPN and client verification stay identical (an exception in the
callback would abort that handshake, so nothing is built there). Session tickets are sealed with
the first context's keys (OpenSSL keeps the context a connection started on for its session), so
a client resumes across rotations as long as the process lives.

gRPC (grpc.aio): the server takes `grpc.dynamic_ssl_server_credentials`, whose fetcher the C core
calls (from its own threads) before each new handshake; it answers with the new configuration
once per generation, `None` (keep) otherwise. grpcio's credentials either require a client
certificate or do not ask for one, so the gRPC listener supports client_cert off and required.

Files that do not load (unreadable, garbage, a key that does not match, an expired certificate)
keep the old context serving; the reason is logged once per change, shown in /readyz and
/admin/state, and counted (`sluice_tls_reloads_total`, `sluice_tls_stale`). The served
certificate's not-after is the gauge `sluice_tls_certificate_expiry_timestamp_seconds`.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import TYPE_CHECKING, Any, Final

from gateway.errors import TlsError
from gateway.services import ServiceKey
from gateway.telemetry import edge_metrics
from gateway.tls.material import Changing, Material, load_material, signature

if TYPE_CHECKING:
    import grpc

    from gateway.policy.base import Listener, ListenerTls
    from gateway.services import Services

log = logging.getLogger("sluice.tls")

# ALPN protocols per listener, in preference order. The HTTP listener offers "h2" first: the
# native engine hands such a connection to the HTTP/2 engine; the aiohttp engine (HTTP/1.1 only)
# offers HTTP1_ONLY instead.
ALPN: dict[str, tuple[str, ...]] = {
    "http": ("h2", "http/1.1"),
    "grpc": ("h2",),
}
HTTP1_ONLY = ("http/1.1",)


EXPIRY_WARNING_S = 7 * 86400.0  # the status page turns yellow this long before the not-after


class TlsOwner:
    """The TLS of one listener: its context, its rotation and what it reports."""

    def __init__(
        self, listener: str, cfg: ListenerTls, alpn: tuple[str, ...] | None = None
    ) -> None:
        self.listener = listener
        self.cfg = cfg
        self.alpn = alpn if alpn is not None else ALPN[listener]
        try:
            material = load_material(cfg, self.alpn)
        except TlsError as e:
            raise TlsError(e.field, e.reason, f"listeners.{listener}.tls.{e.field}: {e}") from None
        except Changing:  # being written while we start: one more read settles it
            material = load_material(cfg, self.alpn)
        self.material = material
        self.context = material.context  # what the listener is bound with, for good
        self._current = self.context  # sni_callback set at the first rotation (see above)
        self.generation = 0
        self._seen = material.signature  # the last signature observed
        self._tried = material.signature  # the last signature loaded (or tried)
        self.error = ""  # why the files on disk are not what is served ("" = they are)
        self.error_reason = ""
        self.loaded_at = time.time()
        self._grpc_generation = 0
        self._task: asyncio.Task[None] | None = None
        edge_metrics.TLS_CERT_EXPIRY.labels(listener).set(material.not_after)
        edge_metrics.TLS_STALE.labels(listener).set(0)

    @property
    def verifies_clients(self) -> bool:
        return self.cfg.client_ca is not None and self.cfg.client_cert != "off"

    def _sni(self, sslobj: Any, server_name: str | None, ctx: ssl.SSLContext) -> None:
        # Runs inside every handshake on the listener's first context: switch to the current one.
        # Nothing here may raise (an exception aborts the handshake).
        current = self._current
        if current is not ctx:
            sslobj.context = current

    # --- rotation ---

    def poll(self, now: float | None = None) -> bool:
        """Look at the files once; load a change that held still since the last look. True when
        a new context went live."""
        sig = signature(self.cfg)
        if sig != self._seen:
            self._seen = sig  # changed: give the writer until the next look
            return False
        if sig == self._tried:
            return False
        self._tried = sig
        try:
            material = load_material(self.cfg, self.alpn, now)
        except Changing:
            self._tried = ()  # written again while loading: try at the next look
            return False
        except TlsError as e:
            self._failed(e)
            return False
        self._swap(material)
        return True

    def _failed(self, e: TlsError) -> None:
        edge_metrics.TLS_RELOADS.labels(self.listener, e.reason).inc()
        edge_metrics.TLS_STALE.labels(self.listener).set(1)
        self.error, self.error_reason = f"listeners.{self.listener}.tls.{e.field}: {e}", e.reason
        log.error(
            "TLS files of the %s listener changed but do not load (%s); still serving the "
            "certificate with serial %x",
            self.listener,
            self.error,
            self.material.serial,
        )

    def _swap(self, material: Material) -> None:
        self.material = material
        self._current = material.context
        self.context.sni_callback = self._sni  # from now on handshakes move to the current one
        self.generation += 1
        self.loaded_at = time.time()
        self.error = self.error_reason = ""
        edge_metrics.TLS_RELOADS.labels(self.listener, "ok").inc()
        edge_metrics.TLS_STALE.labels(self.listener).set(0)
        edge_metrics.TLS_CERT_EXPIRY.labels(self.listener).set(material.not_after)
        log.info(
            "TLS certificate of the %s listener rotated: serial %x, %s, valid until %s",
            self.listener,
            material.serial,
            material.subject,
            _utc(material.not_after),
        )

    def start(self, services: Services, interval_s: float) -> None:
        """Poll the files every `interval_s` in a task the services own (cancelled at close)."""
        if self._task is None:
            self._task = services.spawn(self._watch(interval_s), name=f"tls.{self.listener}")

    async def _watch(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.poll()
            except Exception:  # a bug in one look must not end the watching
                log.exception("looking at the TLS files of the %s listener failed", self.listener)

    # --- gRPC ---

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Server credentials that follow this owner's rotations (grpc.aio's secure port)."""
        import grpc

        first = self._grpc_config(self.material)
        self._grpc_generation = self.generation
        return grpc.dynamic_ssl_server_credentials(
            first, self._fetch, require_client_authentication=self.cfg.client_cert == "required"
        )

    def _fetch(self) -> Any:
        # Called by grpc's C core before a new handshake, from one of its threads: read the
        # current material once and answer with it when it is newer than the last answer.
        material, generation = self.material, self.generation
        if generation == self._grpc_generation:
            return None
        self._grpc_generation = generation
        return self._grpc_config(material)

    def _grpc_config(self, m: Material) -> Any:
        import grpc

        root = m.ca_pem if self.verifies_clients else None
        return grpc.ssl_server_certificate_configuration([(m.key_pem, m.cert_pem)], root)

    # --- reports ---

    def readiness(self) -> dict[str, Any]:
        """/readyz detail: what is served and, when the files do not load, why."""
        m = self.material
        out: dict[str, Any] = {
            "serial": f"{m.serial:x}",
            "not_after": _utc(m.not_after),
            "expires_in_s": round(m.not_after - time.time()),
        }
        if self.error:
            out["error"] = self.error
            out["stale"] = True
        return out

    def state(self) -> dict[str, Any]:
        """/admin/state section; its colour joins the status page's: yellow while stale or
        within `EXPIRY_WARNING_S` of the not-after, red once the served certificate expired."""
        m = self.material
        left = m.not_after - time.time()
        colour = (
            "red" if left <= 0 else "yellow" if self.error or left < EXPIRY_WARNING_S else "green"
        )
        return {
            **self.readiness(),
            "colour": colour,
            "subject": m.subject,
            "cert": self.cfg.cert,
            "client_cert": self.cfg.client_cert,
            "alpn": list(self.alpn),
            "rotations": self.generation,
            "loaded_at": _utc(self.loaded_at),
        }


# One owner per listener that terminates TLS (the services name them `tls.http`, `tls.grpc`).
TLS_KEYS: Final = {
    "http": ServiceKey[TlsOwner]("tls.http"),
    "grpc": ServiceKey[TlsOwner]("tls.grpc"),
}


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def listener_tls(
    services: Services, listener: str, cfg: ListenerTls, alpn: tuple[str, ...] | None = None
) -> TlsOwner:
    """The TLS owner of `listener` (created on first use; a listener binds once per process),
    watching its files; `alpn` overrides the listener's protocols (`ALPN`)."""
    from gateway.settings import Settings

    owner = services.get(TLS_KEYS[listener], lambda: TlsOwner(listener, cfg, alpn))
    owner.start(services, Settings.from_env().tls_watch_interval_s)
    return owner


def server_tls(
    services: Services, listener: Listener | None, http2: bool = True
) -> TlsOwner | None:
    """The TLS owner of the HTTP listener, or None when it serves plaintext; `http2`: ALPN
    offers h2 (the native engine), else HTTP/1.1 only (aiohttp)."""
    if listener is None or listener.tls is None:
        return None
    return listener_tls(services, "http", listener.tls, None if http2 else HTTP1_ONLY)
