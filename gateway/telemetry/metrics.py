"""Every Prometheus metric of Sluice, defined once, in one registry owned by the process.

Label values come from the policy (route, backend names) or small closed sets (code, protocol):
never from request data, so the number of series stays bounded.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.telemetry.tally import flush as flush

REGISTRY = CollectorRegistry(auto_describe=True)


class _Flusher:
    """Registered first: any collection of REGISTRY (a scrape, `get_sample_value`) moves the
    pending tallies into their children before the metrics are read."""

    def collect(self) -> list[Any]:
        flush()
        return []

    def describe(self) -> list[Any]:
        return []


REGISTRY.register(_Flusher())

# Latency buckets up to 60 s: LLM streams are long.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

REQUESTS = Counter(
    "sluice_requests_total",
    "Requests finished, by route, backend, status code and protocol.",
    ["route", "backend", "code", "protocol"],
    registry=REGISTRY,
)
REQUEST_SECONDS = Histogram(
    "sluice_request_duration_seconds",
    "Request duration from arrival to the last byte sent.",
    ["route", "protocol"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
UPSTREAM_FIRST_BYTE_SECONDS = Histogram(
    "sluice_upstream_first_byte_seconds",
    "From request sent upstream to response headers received.",
    ["backend", "protocol"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
OVERHEAD_SECONDS = Histogram(
    "sluice_overhead_seconds",
    "Time spent in Sluice until the answer's head, the upstream's time excluded (the "
    "x-sluice-overhead-ms header).",
    ["route", "protocol"],
    buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0),
    registry=REGISTRY,
)
FIRST_TOKEN_RETRIES = Counter(
    "sluice_first_token_retries_total",
    "Streams tried again on another member because the backend failed before the first token, "
    "by route and failure (reset, error_event, stall, http_5xx).",
    ["route", "kind"],
    registry=REGISTRY,
)
IN_FLIGHT = Gauge(
    "sluice_requests_in_flight",
    "Requests being served now (sampled every second; summed over workers).",
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
UPSTREAM_ERRORS = Counter(
    "sluice_upstream_errors_total",
    "Upstream failures by backend and kind (connect, timeout, protocol, reset).",
    ["backend", "kind"],
    registry=REGISTRY,
)
REJECTED = Counter(
    "sluice_rejected_total",
    "Requests refused before reaching a backend, by reason.",
    ["reason", "protocol"],
    registry=REGISTRY,
)
CLIENT_CANCELLED = Counter(
    "sluice_client_cancelled_total",
    "Requests the client abandoned before the response finished.",
    ["protocol"],
    registry=REGISTRY,
)
UPSTREAM_CONNECTIONS = Gauge(
    "sluice_upstream_connections",
    "Open upstream HTTP connections by backend and state (idle, busy).",
    ["backend", "state"],
    registry=REGISTRY,
)
POLICY_RELOADS = Counter(
    "sluice_policy_reloads_total",
    "Policy reload attempts by result (ok, error, unchanged).",
    ["result"],
    registry=REGISTRY,
)
POLICY_INFO = Gauge(
    "sluice_policy_info",
    "1 for the policy version now serving.",
    ["version"],
    registry=REGISTRY,
)
POLICY_LAST_RELOAD_OK = Gauge(
    "sluice_policy_last_reload_success",
    "1 if the last reload attempt succeeded, 0 if it was rejected.",
    registry=REGISTRY,
)
READY = Gauge("sluice_ready", "1 when the gateway accepts traffic.", registry=REGISTRY)
WORKER_RESTARTS = Counter(
    "sluice_worker_restarts_total",
    "Workers started by the `--workers` supervisor to replace one that died, by how it ended: "
    "signal (killed: the OOM killer, a crash) or exit (exited by itself).",
    ["reason"],
    registry=REGISTRY,
)


GRPC_ENDED_BEFORE_HANDLER = Counter(
    "sluice_grpc_calls_ended_before_handler_total",
    "gRPC calls grpc ended before Sluice's handler ran (so in no other request metric and not "
    "in the access log): reason cancelled (by the client) or no_request (no request message).",
    ["reason"],
    registry=REGISTRY,
)


# --- access log -----------------------------------------------------------------------------
ACCESS_LOG_DROPPED = Counter(
    "sluice_access_log_dropped_total",
    "Access log lines (or batches) dropped because stderr was stalled or broken.",
    registry=REGISTRY,
)

# --- fair admission (gateway.filters.admission; the queue lengths are read at scrape time by
# gateway.admission.collector: sluice_admission_queue_length{pool,class}) ----------------------
ADMISSION_WAIT = Histogram(
    "sluice_admission_wait_seconds",
    "Time a request waited in its backend pool's admission queue (0 when a slot was free).",
    ["pool", "class"],
    buckets=(0.0, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    registry=REGISTRY,
)
ADMISSION_REFUSED = Counter(
    "sluice_admission_refused_total",
    "Requests the admission queue refused, by reason (queue_full, queue_timeout, "
    "deadline_unreachable, shed).",
    ["pool", "class", "reason"],
    registry=REGISTRY,
)

# --- LLM streams and tokens (recorded by record_request from the context) -----------------
TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
)  # fmt: skip
TIME_TO_FIRST_TOKEN = Histogram(
    "sluice_time_to_first_token_seconds",
    "Streams: from request arrival to the first output event sent to the client.",
    ["route", "backend"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
INTER_TOKEN_LATENCY = Histogram(
    "sluice_inter_token_latency_seconds",
    "Streams: mean time between output tokens (events) after the first, one sample per stream.",
    ["route", "backend"],
    buckets=TOKEN_LATENCY_BUCKETS,
    registry=REGISTRY,
)
TOKENS = Counter(
    "sluice_tokens_total",
    "LLM tokens the backends reported (usage), by route, backend and type (input, output).",
    ["route", "backend", "type"],
    registry=REGISTRY,
)

# --- token budgets (gateway/filters/budget.py, gateway/budgets/) ---------------------------
BUDGET_REFUSED = Counter(
    "sluice_budget_refused_total",
    "Requests a token budget refused, by rule and reason (exhausted, store_down; shadow_ "
    "prefix: a rule in shadow mode would have refused).",
    ["rule", "reason"],
    registry=REGISTRY,
)
BUDGET_WARNINGS = Counter(
    "sluice_budget_warnings_total",
    "Keys of a budget that passed a warn_at fraction in their period (once per key, fraction "
    "and replica).",
    ["rule", "level"],
    registry=REGISTRY,
)
BUDGET_TOKENS = Counter(
    "sluice_budget_tokens_total",
    "Weighted tokens charged to budgets (settled from the backends' usage), by rule.",
    ["rule"],
    registry=REGISTRY,
)
BUDGET_EXPIRED = Counter(
    "sluice_budget_expired_tokens_total",
    "Open reservations of dead replicas that the store counted as spent, by rule.",
    ["rule"],
    registry=REGISTRY,
)
BUDGET_STORE_UP = Gauge(
    "sluice_budget_store_up",
    "1 while the budget store answers, 0 while budgets decide on their local share.",
    registry=REGISTRY,
    multiprocess_mode="min",
)

# --- tracing (tail sampler; gateway/filters/trace.py, gateway/telemetry/tracing.py) --------
TRACE_DECISIONS = Counter(
    "sluice_trace_decisions_total",
    "Tail-sampling decisions by reason (error, timeout, rejected, slow, linked, ratio: kept; "
    "not_sampled: dropped).",
    ["reason"],
    registry=REGISTRY,
)
TRACE_DROPPED = Counter(
    "sluice_trace_dropped_total",
    "Kept traces or spans lost before export, by reason (pending_full: traces; build_failed, "
    "spans_per_trace, export_queue_full: spans).",
    ["reason"],
    registry=REGISTRY,
)
TRACE_SPANS_EXPORTED = Counter(
    "sluice_trace_spans_exported_total",
    "Spans the OTLP exporter finished, by result (ok, failed).",
    ["result"],
    registry=REGISTRY,
)
TRACE_PENDING = Gauge(
    "sluice_trace_pending",
    "Kept traces waiting for export.",
    registry=REGISTRY,
    multiprocess_mode="livesum",
)


# --- policy safety: change guard and staged rollouts (gateway/reload/) ---
POLICY_HELD = Gauge(
    "sluice_policy_held",
    "1 while the latest policy change is held by the change guard (not applied).",
    registry=REGISTRY,
)
POLICY_GUARD_SHARE = Gauge(
    "sluice_policy_guard_affected_share",
    "Share of recent traffic the last policy change checked by the guard would refuse.",
    registry=REGISTRY,
)
POLICY_ROLLOUT_STAGE = Gauge(
    "sluice_policy_rollout_percent",
    "Percentage of requests served by the policy being rolled out (0 in shadow, -1 = none).",
    registry=REGISTRY,
)
POLICY_ROLLOUTS = Counter(
    "sluice_policy_rollouts_total",
    "Staged policy rollouts by how they ended (completed, rolled_back, aborted).",
    ["result"],
    registry=REGISTRY,
)
POLICY_ROLLOUT_REQUESTS = Counter(
    "sluice_policy_rollout_requests_total",
    "Requests served during staged rollouts, by side (old, new policy).",
    ["side"],
    registry=REGISTRY,
)
POLICY_ROLLOUT_ERROR_RATE = Gauge(
    "sluice_policy_rollout_error_rate",
    "Error rate of each side in the current rollout stage.",
    ["side"],
    registry=REGISTRY,
)
POLICY_ROLLOUT_P95 = Gauge(
    "sluice_policy_rollout_p95_seconds",
    "p95 request duration of each side in the current rollout stage.",
    ["side"],
    registry=REGISTRY,
)
POLICY_ROLLOUT_STAGE.set(-1)
# --- backends (breakers, outliers, health, registry, retries, canary) -----------------------
# Events are counted here; member state (breaker, health, ejection, weight, load, in flight,
# registry, retry budget, canary) is read at scrape time by gateway.registry.collector.
BREAKER_TRANSITIONS = Counter(
    "sluice_breaker_transitions_total",
    "Circuit breaker transitions by backend and new state (open, half_open, closed).",
    ["backend", "state"],
    registry=REGISTRY,
)
OUTLIER_EJECTIONS = Counter(
    "sluice_outlier_ejections_total",
    "Members ejected for their timeout ratio, by backend.",
    ["backend"],
    registry=REGISTRY,
)
HEALTH_CHECKS = Counter(
    "sluice_health_checks_total",
    "Active health checks by backend and result (pass, fail).",
    ["backend", "result"],
    registry=REGISTRY,
)
SERVER_SCRAPES = Counter(
    "sluice_server_scrapes_total",
    "Scrapes of the members' model-server metrics (load.metrics) by backend and result (ok, "
    "error).",
    ["backend", "result"],
    registry=REGISTRY,
)
DNS_LOOKUPS = Counter(
    "sluice_dns_lookups_total",
    "DNS discovery lookups by backend and result (ok; empty and error keep the last members).",
    ["backend", "result"],
    registry=REGISTRY,
)
MODEL_LISTINGS = Counter(
    "sluice_model_listings_total",
    "Reads of members' model listings (GET /v1/models) by backend and result (ok, error).",
    ["backend", "result"],
    registry=REGISTRY,
)
REGISTRY_POLLS = Counter(
    "sluice_registry_polls_total",
    "Reads of the heartbeat registry by backend and result (ok, error).",
    ["backend", "result"],
    registry=REGISTRY,
)
RETRIES = Counter(
    "sluice_retries_total",
    "Retry decisions by route and result (attempted, budget_exhausted, no_member).",
    ["route", "result"],
    registry=REGISTRY,
)
CANARY_TRIPS = Counter(
    "sluice_canary_guard_trips_total",
    "Canary guards tripped (canary weight set to 0), by route and canary backend.",
    ["route", "backend"],
    registry=REGISTRY,
)

# --- rate limits (gateway/ratelimit; counters flushed from plain ints once a second) --------
RL_DECISIONS = Counter(
    "sluice_ratelimit_decisions_total",
    "Limiter decisions by rule: admit, reject_qps, reject_tokens, reject_pressure, "
    "shed_yellow, shed_red, shadow_reject, shadow_shed, queued, strict_fallback, token_cut.",
    ["rule", "decision"],
    registry=REGISTRY,
)
RL_SIGNAL = Gauge(
    "sluice_ratelimit_signal",
    "Highest signal of any key of a rule over the last second: qps (offered / limit), "
    "tokens (1 - available / capacity), pressure (the weighted score).",
    ["rule", "signal"],
    registry=REGISTRY,
    multiprocess_mode="max",
)
RL_KEYS = Gauge(
    "sluice_ratelimit_keys",
    "Keys a rule remembers, by colour (green, yellow, red).",
    ["rule", "colour"],
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
RL_COLOUR = Gauge(
    "sluice_ratelimit_colour",
    "Overload colour (0 green, 1 yellow, 2 red) of the gateway and of each backend pool.",
    ["scope"],
    registry=REGISTRY,
    multiprocess_mode="max",
)
RL_COLOUR_CHANGES = Counter(
    "sluice_ratelimit_colour_changes_total",
    "Colour transitions of keys and pools, by the colour entered (yellow/red count as alerts).",
    ["scope", "to"],
    registry=REGISTRY,
)
RL_STORE_MODE = Gauge(
    "sluice_ratelimit_store_mode",
    "1 for the limiter's current mode: memory, redis (leased shares), fallback (Redis away: "
    "local buckets sized by limit / live replicas).",
    ["mode"],
    registry=REGISTRY,
    multiprocess_mode="max",
)
RL_REDIS_ERRORS = Counter(
    "sluice_ratelimit_redis_errors_total",
    "Redis calls of the limiter that failed or passed their deadline, by operation.",
    ["op"],
    registry=REGISTRY,
)
RL_SYNC_SECONDS = Histogram(
    "sluice_ratelimit_sync_seconds",
    "Duration of one lease sync (one pipelined round trip for every active key).",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1),
    registry=REGISTRY,
)
RL_REPLICAS = Gauge(
    "sluice_ratelimit_replicas",
    "Live replicas announced in Redis (the fallback divides each limit by it).",
    registry=REGISTRY,
    multiprocess_mode="max",
)
RL_OUTSTANDING = Gauge(
    "sluice_ratelimit_leased",
    "Shares leased from Redis and not yet used, by rule and kind (requests, tokens): the "
    "bound on how far replicas can overshoot a global limit between two syncs.",
    ["rule", "kind"],
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
RL_TOKENS = Counter(
    "sluice_ratelimit_tokens_total",
    "LLM tokens by rule: reserved at admission, refunded after the real usage, charged "
    "beyond the reservation (overruns).",
    ["rule", "kind"],
    registry=REGISTRY,
)
RL_CONCURRENCY = Gauge(
    "sluice_concurrency",
    "Adaptive concurrency per backend pool: limit and in_flight.",
    ["pool", "kind"],
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
FLEET_STORE_MODE = Gauge(
    "sluice_fleet_store_mode",
    "1 for the fleet store's current mode: none (no shared store: this replica alone), shared "
    "(the store answers), fallback (the store is away: each replica decides on its last known "
    "share).",
    ["mode"],
    registry=REGISTRY,
    multiprocess_mode="max",
)
FLEET_REPLICAS = Gauge(
    "sluice_fleet_replicas",
    "Live replicas (gateway processes) announced in the fleet store, last known.",
    registry=REGISTRY,
    multiprocess_mode="max",
)
FLEET_STORE_ERRORS = Counter(
    "sluice_fleet_store_errors_total",
    "Fleet store calls that failed or passed their deadline, by operation.",
    ["op"],
    registry=REGISTRY,
)
FLEET_SLOTS = Gauge(
    "sluice_fleet_slots",
    "Backend slots (max_in_flight) per pool: held (leased by this process from the store, or "
    "its fallback share), in_flight (this process), fleet_in_flight (every replica, last "
    "sync), capacity (the pool's max_in_flight for the whole fleet).",
    ["pool", "kind"],
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
