"""The one exception tree of Sluice. Adapters catch `GatewayError`; nothing else escapes a request.

GatewayError
  + PolicyError          bad YAML/schema: fatal at boot; on reload the old policy keeps serving
  + UpstreamError        a backend failed us (the adapter maps it to 502/504 or UNAVAILABLE)
  |   + UpstreamConnectError   could not connect (or the pool is exhausted)
  |   |   + UpstreamTlsError       the TLS handshake failed (verification, name, client cert)
  |   + UpstreamTimeout        connect / first-byte / idle / total deadline expired
  |   + UpstreamProtocolError  the backend spoke broken HTTP
  + StoreUnavailable     Redis down/timeout: each rule says fail_open or fail_closed
  + DatapathError        BPF compile/attach failure: fatal only if the datapath is required
  + HostTuneError        a host setting could not be read, applied or rolled back
  + AdminError           `sluice policy ... --against/--admin`: the running gateway's admin API
                         could not be reached or refused the request
  + JwksError            a JWKS fetch failed: the last good key set stays in force
  |   + JwksInvalid          the document is not an acceptable key set (HTML, weak key, ...)
  + TlsError             a listener's certificate, key or client CA does not load: fatal at
                         start; a changed file that does not load keeps the old one serving.
                         A backend's `tls` file that does not load: a policy error at its field
"""

from __future__ import annotations


class GatewayError(Exception):
    """Base of every error Sluice raises on purpose."""


class PolicyError(GatewayError):
    """A policy document is invalid. `errors` holds one `PATH:LINE:COL: message` per problem."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


class UpstreamError(GatewayError):
    """A backend could not serve the request."""


class UpstreamConnectError(UpstreamError):
    """Connecting to the backend failed, or no connection could be had in time."""


class UpstreamTlsError(UpstreamConnectError):
    """The TLS handshake with the backend failed: its certificate did not verify (unknown CA,
    wrong name, expired), or it refused ours. Nothing was sent."""


class UpstreamTimeout(UpstreamError):
    """A connect, first-byte, idle or total deadline expired while talking to the backend."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        super().__init__(f"upstream {phase} timeout")


class UpstreamProtocolError(UpstreamError):
    """The backend answered with something that is not valid HTTP/1.1."""


class StoreUnavailable(GatewayError):
    """The shared store (Redis) did not answer within its deadline."""


class DatapathError(GatewayError):
    """The eBPF datapath could not be compiled, loaded, attached or read."""


class HostTuneError(GatewayError):
    """A host network setting could not be read, applied or rolled back."""


class AdminError(GatewayError):
    """A running gateway's admin API could not be reached, or answered with an error."""


class JwksError(GatewayError):
    """A JWKS could not be fetched or read. `kind` is a metric label (timeout, http_error,
    unreachable, unreadable, too_large, invalid); `reason` adds a short detail, safe to log
    (never key material)."""

    def __init__(self, kind: str, detail: str = "") -> None:
        self.kind = kind
        self.reason = f"{kind}: {detail}" if detail else kind
        super().__init__(self.reason)


class JwksInvalid(JwksError):
    """A JWKS document was fetched but is not an acceptable key set."""

    def __init__(self, detail: str, kind: str = "invalid") -> None:
        super().__init__(kind, detail)


class TlsError(GatewayError):
    """A listener's (or a backend's) TLS files do not load. `field` names the policy field at
    fault (cert, key, client_ca; a backend's ca, cert, key), `reason` a short class for metrics
    (unreadable, invalid, mismatch, expired, not_yet_valid)."""

    def __init__(self, field: str, reason: str, message: str) -> None:
        super().__init__(message)
        self.field, self.reason, self.message = field, reason, message
