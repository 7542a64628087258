"""Policy model: routes (match, weighted backends, canary, retries, sticky users, affinity).
Nothing here does I/O."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from gateway.policy.auth import RouteAuthSetting
from gateway.policy.base import PolicyModel, Timeouts
from gateway.policy.llm import Affinity, ModelGlob


class HeaderMatch(PolicyModel):
    name: str = Field(min_length=1, description="header (HTTP) or metadata key (gRPC)")
    value: str | None = Field(
        default=None, description="exact value; null = present with any value"
    )


class RouteMatch(PolicyModel):
    protocol: Literal["http", "grpc", "any"] = Field(default="any", description="which listener")
    path_prefix: str = Field(
        default="/", description="HTTP path prefix, or gRPC '/pkg.Service/' prefix"
    )
    methods: list[str] = Field(
        default_factory=list, description="HTTP methods; empty = any (gRPC is always POST)"
    )
    headers: list[HeaderMatch] = Field(default_factory=list, description="all must match")
    model: list[ModelGlob] = Field(
        default_factory=list,
        max_length=256,
        description="globs on the JSON body's `model` (gRPC: the request's `model_name`); one "
        "must match; empty = any request, with or without a model",
    )


class WeightedBackend(PolicyModel):
    backend: str = Field(description="backend name")
    weight: int = Field(
        default=1, ge=0, le=10000, description="relative share of this route's traffic"
    )


class Canary(PolicyModel):
    """The canary's p95 and error ratio against the stable version's; a breach sets its weight
    to 0 until a policy change to this route's canary or weights."""

    backend: str = Field(description="which of the route's backends is the canary")
    p95_ms: PositiveFloat = Field(default=200.0, description="p95 time to first byte allowed")
    max_error_ratio: float = Field(default=0.02, ge=0, le=1, description="error share allowed")
    window_s: PositiveFloat = Field(default=60.0, description="sliding window compared")
    min_requests: PositiveInt = Field(
        default=20, description="canary results needed in the window before it is judged"
    )
    override_header: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9\-_]+$",
        description="header forcing the choice: 1/true/canary → canary, 0/false/stable → not",
    )


RetryOn = Literal["connect_failure", "unavailable"]
RETRY_ON: tuple[RetryOn, ...] = ("connect_failure", "unavailable")


class Retries(PolicyModel):
    """Retry where safe: connect failures, or 503 / UNAVAILABLE before any byte reached the
    client; never once a response started; bounded by a budget."""

    attempts: int = Field(default=2, ge=1, le=5, description="tries in total, the first included")
    budget_ratio: float = Field(
        default=0.2, ge=0, le=1, description="retries in flight ≤ this share of active requests"
    )
    min_retries: int = Field(
        default=3, ge=0, le=1000, description="retries in flight always allowed (budget floor)"
    )
    per_try_timeout_s: PositiveFloat | None = Field(
        default=None, description="each try's deadline up to its first response byte"
    )
    retry_on: list[RetryOn] = Field(
        default_factory=lambda: list(RETRY_ON),
        description="connect_failure; unavailable (HTTP 503 / gRPC UNAVAILABLE)",
    )
    before_first_token: bool = Field(
        default=False,
        description="streams: hold the head and role-only events until the first content (up "
        "to timeouts.first_byte_s and 64 KiB), and retry a member that fails before it "
        "(reset, 5xx, an SSE error event, a stall); never once content reached the client",
    )


class Sticky(PolicyModel):
    header: str = Field(
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9\-_]+$",
        description="hash this header (e.g. a user id): the same value keeps its backend and "
        "member; requests without it are balanced normally",
    )


class Route(PolicyModel):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$", description="metrics label")
    match: RouteMatch = Field(
        default_factory=RouteMatch, description="first route that matches wins"
    )
    backend: str | None = Field(default=None, description="one backend (or use `backends`)")
    backends: list[WeightedBackend] = Field(
        default_factory=list, description="weighted split between backends"
    )
    timeouts: Timeouts | None = Field(default=None, description="overrides the global timeouts")
    strip_prefix: str = Field(
        default="", description="removed from the HTTP path before forwarding"
    )
    canary: Canary | None = Field(default=None, description="guard of a canary backend (off)")
    retries: Retries | None = Field(default=None, description="retries where safe (off)")
    sticky: Sticky | None = Field(
        default=None, description="header-hash stickiness instead of least-loaded choice"
    )
    auth: RouteAuthSetting | None = Field(
        default=None,
        description="required | optional | off, or {required, claims, providers}; "
        "null = `auth.default`",
    )
    by_model: bool = Field(
        default=False,
        description="the body's model keeps only the backends and members that serve it "
        "(`backends[].models`); a model none serves is a 404 model_not_found; GET /v1/models "
        "answers the union",
    )
    affinity: Affinity | None = Field(
        default=None, description="requests with the same prompt prefix to the same member"
    )
    api: Literal["auto", "chat", "completions", "embeddings", "responses", "messages"] = Field(
        default="auto",
        description="the API family its requests speak (how bodies, usage and errors are read "
        "and written); auto = by path: /v1/chat/completions, /v1/completions, /v1/embeddings, "
        "/v1/responses, /v1/messages (/v1/messages/count_tokens passes through uncounted)",
    )

    @model_validator(mode="after")
    def _one_target(self) -> Route:
        if (self.backend is None) == (not self.backends):
            raise ValueError("set exactly one of `backend` or `backends`")
        return self
