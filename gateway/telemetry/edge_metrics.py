"""The metrics of what guards the edge: JWT auth and its key sets, the TLS listeners'
certificates, the kernel datapath. In the one registry of `gateway.telemetry.metrics` (the
admin listener imports this module, so they are exported whether or not a feature is on).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from gateway.telemetry.metrics import REGISTRY

# --- auth (JWT; written by gateway/filters/auth.py and gateway/auth/jwks.py) ----------------
AUTH_RESULTS = Counter(
    "sluice_auth_total",
    "Authentication results by provider ('none' when no provider matched) and result: ok, "
    "cached (a verified-token cache hit) or the reason class of a refusal (missing, malformed, "
    "expired, bad_signature, unknown_kid, audience, claims, ...).",
    ["provider", "result"],
    registry=REGISTRY,
)
JWKS_FETCHES = Counter(
    "sluice_jwks_fetches_total",
    "JWKS fetches by provider and result: ok, unchanged, or the failure (timeout, http_error, "
    "invalid, too_large, unreachable); a failure keeps the last good key set.",
    ["provider", "result"],
    registry=REGISTRY,
)
JWKS_KEYS = Gauge(
    "sluice_jwks_keys",
    "Keys in the provider's key set now in force (0: none loaded, or dropped after max_stale).",
    ["provider"],
    registry=REGISTRY,
    multiprocess_mode="min",
)
JWKS_LAST_SUCCESS = Gauge(
    "sluice_jwks_last_success_timestamp_seconds",
    "Unix time of the provider's last good JWKS fetch (age = time() - this).",
    ["provider"],
    registry=REGISTRY,
    multiprocess_mode="min",
)


# --- TLS listeners -----------------------------------------------------------------------------
TLS_CERT_EXPIRY = Gauge(
    "sluice_tls_certificate_expiry_timestamp_seconds",
    "Not-after of the certificate a TLS listener serves now (Unix time).",
    ["listener"],
    registry=REGISTRY,
    multiprocess_mode="min",
)
TLS_RELOADS = Counter(
    "sluice_tls_reloads_total",
    "Changes of a TLS listener's certificate files by result: ok, or why they did not load "
    "(unreadable, invalid, mismatch, expired, not_yet_valid); a failure keeps the old one.",
    ["listener", "result"],
    registry=REGISTRY,
)
TLS_STALE = Gauge(
    "sluice_tls_stale",
    "1 while a TLS listener serves its previous certificate because the changed files do not load.",
    ["listener"],
    registry=REGISTRY,
    multiprocess_mode="max",
)


# --- datapath (eBPF TC classifier; written by gateway/datapath/sync.py) ---------------------
DATAPATH_UP = Gauge(
    "sluice_datapath_up",
    "1 while the TC classifier is attached and its maps sync; 0 when off or failed.",
    registry=REGISTRY,
)
DATAPATH_EVENTS = Counter(
    "sluice_datapath_events_total",
    "Kernel classifier counters (packets, bytes, syn_drop, stream_drop, deny_drop, "
    "rapid_reset_drop, rapid_reset_flows, h2_resync, h2_lost, deny_expired, header_block_flows, "
    "ping_flood_flows, flood_drop, h2_ooo_drop, ...) and blocked_flows_closed (server sockets "
    "of blocked flows aborted by the gateway).",
    ["event"],
    registry=REGISTRY,
)
DATAPATH_DENIED = Gauge(
    "sluice_datapath_denied_sources",
    "Source addresses the kernel sheds now (deny entries not yet expired).",
    registry=REGISTRY,
)
DATAPATH_SYNC_ERRORS = Counter(
    "sluice_datapath_sync_errors_total",
    "Failed map syncs between the gateway and the classifier.",
    registry=REGISTRY,
)
