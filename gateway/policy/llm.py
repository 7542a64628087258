"""Policy model: what makes routing LLM-aware: the models a backend serves (`backends[].models`),
a route's prefix affinity (`routes[].affinity`), and the glob list of `routes[].match.model`.
Nothing here does I/O."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from gateway.policy.base import PolicyModel, UrlPath

MAX_MODEL_NAME = 256
MAX_MODELS = 4096

ModelName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=MAX_MODEL_NAME,
        pattern=r"^[\x21-\x7e]+$",
        description="a model or LoRA adapter name, as clients send it in `model`",
    ),
]
ModelGlob = Annotated[
    str,
    Field(
        min_length=1,
        max_length=MAX_MODEL_NAME,
        pattern=r"^[\x21-\x7e]+$",
        description="a glob on the body's `model` (`*` any run, `?` one character, `[..]` a "
        "set; case-sensitive)",
    ),
]


class Models(PolicyModel):
    """The models (and LoRA adapters) a backend serves: listed here, or discovered from each
    member's `GET /v1/models` (the OpenAI listing; vLLM lists adapters with their `parent`)."""

    names: list[ModelName] = Field(
        default_factory=list,
        max_length=MAX_MODELS,
        description="models every member serves (with `discover`, added to what each lists)",
    )
    discover: bool = Field(
        default=False,
        description="ask each member's `GET /v1/models` on a timer and when its health "
        "changes; a member whose listing fails keeps its last known models",
    )
    interval_s: PositiveFloat = Field(
        default=30.0, le=3600, description="between two listings of one member"
    )
    timeout_s: PositiveFloat = Field(default=2.0, le=60, description="deadline of each listing")
    path: UrlPath = Field(default="/v1/models", description="the listing's path")
    max_models: PositiveInt = Field(
        default=1024,
        le=MAX_MODELS,
        description="models and adapters kept per member, at most (the rest are dropped)",
    )
    lora: Literal["loaded", "load_on_demand"] = Field(
        default="loaded",
        description="an adapter no member has loaded: 404 (loaded), or sent to the members "
        "serving its parent model, which load it (load_on_demand; vLLM with "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING and a resolver)",
    )

    @model_validator(mode="after")
    def _some_source(self) -> Models:
        if not self.names and not self.discover:
            raise ValueError("list `names`, or set `discover: true`")
        return self


class PrefixAffinity(PolicyModel):
    """Send requests whose prompts start alike to the same member (its KV cache holds the
    prefix), unless that member is busier than `load_factor` × the backend's mean."""

    bytes: int = Field(
        default=2048,
        ge=16,
        le=65536,
        description="prompt bytes hashed (chat: the system messages, then the others, in order)",
    )
    load_factor: float = Field(
        default=1.25,
        ge=1.0,
        le=10.0,
        description="a member above this × the mean load (in flight + heartbeat load, per "
        "weight) passes the request to the next member in the prefix's hash order",
    )


class Affinity(PolicyModel):
    prefix: PrefixAffinity | None = Field(
        default=None, description="prompt-prefix affinity with bounded load (off)"
    )
