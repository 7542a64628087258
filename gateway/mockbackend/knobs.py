"""Run-time state of the simulated backend: the knobs that shape its behaviour, the statistics
tests assert on, and the few helpers (token counts, fake text) both protocols share.

Knobs change at run time (`MockState.update`, `POST /admin/knobs` on the loopback admin
listener): every request reads them when it starts, so a change applies to the next request, not
to streams already running. Randomness comes from one seeded `random.Random`, so an `error_rate`
run is reproducible. The stats keep request ids and header names, never a header value.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

from gateway.mockbackend.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from gateway.policy.model import MockBackend

FailureMode = Literal[
    "none", "hang", "reset", "http_5xx", "unavailable",
    # Streams that fail before their first token, after the head and a role-only chunk:
    "reset_before_first_token", "error_event", "stall_before_first_token",
]  # fmt: skip
FAILURE_MODES: tuple[str, ...] = get_args(FailureMode)

MAX_RECORDED = 100  # bound on the remembered requests (`Stats.seen`)
MAX_NAMES = 100  # header / metadata names remembered per request
MAX_NAME_CHARS = 64  # longer names are cut (a name is not a value, but it is client input)
MAX_REQUEST_ID_CHARS = 128
MAX_TOKENS_CAP = 100_000  # same upper bound as the policy's completion_tokens
MAX_MODELS = 1024  # models, and adapters, one backend may list
MAX_MODEL_CHARS = 256

# Words the fake completions are made of: one word = one token.
_WORDS = ("sluice", "gates", "hold", "the", "river", "while", "tokens", "flow", "past", "quietly")


@dataclass(slots=True)
class Knobs:
    """What the backend does with the next request. Mutable on purpose; validate with `update`."""

    ttft_ms: float = 50.0  # delay before the first token (and before a unary answer)
    token_delay_ms: float = 10.0  # delay between tokens
    completion_tokens: int = 16  # tokens per completion when the request has no max_tokens
    error_rate: float = 0.0  # share of requests failed with 500 (HTTP) / UNAVAILABLE (gRPC)
    failure: FailureMode = "none"  # failure injected into every request (see README of the CLI)
    error_status: int = 500  # HTTP status of `http_5xx` and of error_rate failures
    usage_trailer: str = "x-mock-usage-tokens"  # gRPC trailing-metadata key for total tokens
    load: float = 0.0  # 0..1, reported as vllm:kv_cache_usage_perc
    waiting: int = 0  # reported as vllm:num_requests_waiting
    healthy: bool = True  # false: /healthz 503 and grpc.health NOT_SERVING
    seed: int = 0  # seed of the error_rate draws; setting it restarts the sequence
    # The models it serves (empty: the built-in list, and any model is answered) and its LoRA
    # adapters (adapter -> parent model); both in /v1/models, and a request for another model
    # gets vLLM's 404. Changing them at run time is a model list changing under the gateway.
    models: list[str] = field(default_factory=list)
    adapters: dict[str, str] = field(default_factory=dict)
    # An adapter it does not list is loaded when asked for (as vLLM's runtime LoRA resolver
    # does): added to `adapters` with the first model as its parent, then answered.
    load_adapters: bool = False
    # Streams start with a role-only chunk (`delta: {role, content: ""}`), as vLLM's do.
    role_preamble: bool = False
    # The prefix cache and prefill cost (gateway.mockbackend.prefix_cache): blocks kept (0 =
    # no cache), characters per block, ms per uncached prompt token on top of ttft_ms, and
    # prefills served at once (0 = no limit).
    prefix_cache_blocks: int = 0
    prefix_block_chars: int = 256
    uncached_token_ms: float = 0.0
    prefill_slots: int = 0
    slots: int = 0  # generation slots (vLLM --max-num-seqs): completions beyond wait, FIFO; 0 = any

    @classmethod
    def from_policy(cls, cfg: MockBackend) -> Knobs:
        """Knobs from the policy section `mock_backend` (the fields it has; the rest default)."""
        return cls(
            ttft_ms=cfg.ttft_ms,
            token_delay_ms=cfg.token_delay_ms,
            completion_tokens=cfg.completion_tokens,
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validated(self, patch: Mapping[str, object]) -> Knobs:
        """A copy with `patch` applied; ValueError names the first bad field; `self` unchanged."""
        if not isinstance(patch, Mapping):
            raise ValueError("knobs must be a JSON object")
        values = self.as_dict()
        for name, value in patch.items():
            if name not in values:
                raise ValueError(f"unknown knob {name!r}")
            values[name] = _check(name, value)
        return Knobs(**values)


def _model_name(v: object) -> bool:
    return isinstance(v, str) and 0 < len(v) <= MAX_MODEL_CHARS and v.isprintable()


def _check(name: str, value: object) -> object:
    """Validate one knob value; returns it normalised (ints to floats where floats are wanted)."""
    if name == "failure":
        if value not in FAILURE_MODES:
            raise ValueError(f"failure must be one of {', '.join(FAILURE_MODES)}")
        return value
    if name == "usage_trailer":
        if not isinstance(value, str) or not value or value != value.lower() or " " in value:
            raise ValueError("usage_trailer must be a non-empty lower-case metadata key")
        return value
    if name == "models":
        if not isinstance(value, list) or not all(_model_name(v) for v in value):
            raise ValueError("models must be a list of model names")
        if len(value) > MAX_MODELS:
            raise ValueError(f"at most {MAX_MODELS} models")
        return list(value)
    if name == "adapters":
        if not isinstance(value, dict) or not all(
            _model_name(k) and _model_name(v) for k, v in value.items()
        ):
            raise ValueError("adapters must map adapter names to their parent model's name")
        if len(value) > MAX_MODELS:
            raise ValueError(f"at most {MAX_MODELS} adapters")
        return dict(value)
    if name in ("healthy", "load_adapters", "role_preamble"):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number")
    bounds: dict[str, tuple[float, float, bool]] = {  # (low, high, integer)
        "ttft_ms": (0, 3_600_000, False),
        "token_delay_ms": (0, 3_600_000, False),
        "completion_tokens": (0, MAX_TOKENS_CAP, True),
        "error_rate": (0, 1, False),
        "error_status": (500, 599, True),
        "load": (0, 1, False),
        "waiting": (0, 1_000_000, True),
        "seed": (-(2**63), 2**63 - 1, True),
        "prefix_cache_blocks": (0, 1_000_000, True),
        "prefix_block_chars": (1, 1 << 20, True),
        "uncached_token_ms": (0, 60_000, False),
        "prefill_slots": (0, 10_000, True),
        "slots": (0, 100_000, True),
    }
    low, high, integer = bounds[name]
    if integer and not isinstance(value, int):
        raise ValueError(f"{name} must be an integer")
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low:g} and {high:g}")
    return value if integer else float(value)


@dataclass(slots=True)
class Call:
    """One request being served; the handler marks `failed` when it injects a failure."""

    endpoint: str
    outcome: Literal["completed", "failed", "cancelled"] = "completed"

    def fail(self) -> None:
        self.outcome = "failed"


@dataclass(frozen=True, slots=True)
class Seen:
    """What the backend remembers of one request: its request id and the NAMES of its headers
    (or gRPC metadata keys), lower-cased and sorted. Never a header value: the admin API shows
    these, and a value may be a credential (`authorization`, `cookie`, an API key)."""

    request_id: str | None
    names: tuple[str, ...]

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, object]]) -> Seen:
        names: set[str] = set()
        request_id: str | None = None
        for name, value in pairs:
            key = name.lower()
            if key == "x-request-id" and isinstance(value, str):
                request_id = value[:MAX_REQUEST_ID_CHARS]
            if len(names) < MAX_NAMES:
                names.add(key[:MAX_NAME_CHARS])
        return cls(request_id, tuple(sorted(names)))

    def as_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "names": list(self.names)}


@dataclass(slots=True)
class Stats:
    """Counters since start (or the last reset). Endpoints are a closed set, so maps stay small."""

    requests: Counter[str] = field(default_factory=Counter)
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    in_flight: int = 0
    generating: int = 0  # completions holding a generation slot now
    peak_generating: int = 0  # the most at once since start (or the last reset)
    seen: deque[Seen] = field(default_factory=lambda: deque(maxlen=MAX_RECORDED))

    def reset(self) -> None:
        """Zero the counters; calls in flight stay counted as in flight."""
        self.requests.clear()
        self.completed = self.failed = self.cancelled = 0
        self.peak_generating = self.generating
        self.seen.clear()

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": dict(self.requests),
            "completed": self.completed,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "in_flight": self.in_flight,
            "generating": self.generating,
            "peak_generating": self.peak_generating,
            "seen": [s.as_dict() for s in self.seen],
        }

    @contextmanager
    def track(self, endpoint: str) -> Iterator[Call]:
        """Count one call. A client that goes away (CancelledError, ConnectionResetError) is
        `cancelled`; any other exception (a gRPC abort included) is `failed`."""
        call = Call(endpoint)
        self.requests[endpoint] += 1
        self.in_flight += 1
        try:
            yield call
        except (asyncio.CancelledError, ConnectionResetError):
            if call.outcome == "completed":  # an injected failure stays a failure
                call.outcome = "cancelled"
            raise
        except BaseException:
            call.outcome = "failed"
            raise
        finally:
            self.in_flight -= 1
            if call.outcome == "completed":
                self.completed += 1
            elif call.outcome == "failed":
                self.failed += 1
            else:
                self.cancelled += 1


KnobsListener = Callable[[Knobs], Awaitable[None]]


class Slots:
    """The backend's generation slots (the `slots` knob): a completion holds one from before its
    first token to its end; beyond them completions wait, first come first served, as a model
    server's own queue does. The waiting is bounded by the client: one that leaves stops waiting."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self.waiters: deque[asyncio.Future[None]] = deque()

    @contextlib.asynccontextmanager
    async def hold(self, knobs: Knobs) -> AsyncIterator[None]:
        st = self.stats
        if knobs.slots and (st.generating >= knobs.slots or self.waiters):
            fut = asyncio.get_running_loop().create_future()
            self.waiters.append(fut)
            try:
                await fut  # handed the slot by the completion that frees it
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._pass(knobs)  # it had been handed the slot: pass it on
                else:
                    with contextlib.suppress(ValueError):  # passed over already if done
                        self.waiters.remove(fut)
                raise
        else:
            st.generating += 1
            if st.generating > st.peak_generating:
                st.peak_generating = st.generating
        try:
            yield
        finally:
            self._pass(knobs)

    def _pass(self, knobs: Knobs) -> None:
        """A slot frees: the oldest waiter takes it (the count stays), else it is given back."""
        while self.waiters and (not knobs.slots or self.stats.generating <= knobs.slots):
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.stats.generating -= 1


class MockState:
    """Knobs + stats + the seeded random source: everything the handlers of both protocols share."""

    def __init__(self, knobs: Knobs) -> None:
        self.knobs = knobs
        self.stats = Stats()
        self.slots = Slots(self.stats)
        self.started = time.monotonic()
        self._rng = random.Random(knobs.seed)
        self.cache = PrefixCache()
        self._listeners: list[KnobsListener] = []

    def on_change(self, listener: KnobsListener) -> None:
        self._listeners.append(listener)

    async def update(self, patch: Mapping[str, object]) -> Knobs:
        """Validate and apply a partial update in place (all or nothing); ValueError if bad."""
        new = self.knobs.validated(patch)
        for f in dataclasses.fields(Knobs):
            setattr(self.knobs, f.name, getattr(new, f.name))
        if "seed" in patch:
            self._rng.seed(self.knobs.seed)
        for listener in self._listeners:
            await listener(self.knobs)
        return self.knobs

    def draw_error(self) -> bool:
        """True when this request should fail under `error_rate` (seeded, so reproducible)."""
        rate = self.knobs.error_rate
        return rate > 0 and self._rng.random() < rate


def estimate_tokens(text: str) -> int:
    """Prompt tokens ≈ UTF-8 bytes / 4, rounded up (the gateway's estimate uses the same rule)."""
    return (len(text.encode()) + 3) // 4


def completion_count(knobs: Knobs, max_tokens: object) -> int:
    """Tokens to produce: the knob's count, capped by the request's max_tokens when it has one."""
    n = knobs.completion_tokens
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 0:
        n = min(n, max_tokens)
    return n


def token_text(index: int) -> str:
    """The text of token `index` (a word and a space), deterministic."""
    return _WORDS[index % len(_WORDS)] + " "


def serves(knobs: Knobs, model: object) -> bool:
    """With a model list set (`models` knob), only its models and adapters are answered."""
    if not knobs.models:
        return True
    return isinstance(model, str) and (model in knobs.models or model in knobs.adapters)
