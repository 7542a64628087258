"""(compiled) The API families a client may speak, and how each one's request and answer are
read. Pure.

Five families: OpenAI chat completions, text completions, embeddings and Responses, and
Anthropic Messages. A request's family comes from its route's `api` (resolved when the policy
loads), or, for `api: auto`, from its path (`/v1/chat/completions`, `/v1/completions`,
`/v1/embeddings`, `/v1/responses`, `/v1/messages`; a prefixed path such as
`/anthropic/v1/messages` by its ending). `/v1/messages/count_tokens` speaks Anthropic's dialect
but is not counted: it generates nothing.

Chat and text completions are read by `gateway.core.body.from_doc` and `usage_from` (the hot
path, unchanged); the other families here:

- the request: model, the output cap (`max_tokens`, `max_completion_tokens`,
  `max_output_tokens`), the prompt's characters (`messages`, `system`, content blocks,
  `input`, `instructions`, tool results included) and `stream`;
- the answer: `usage` of a JSON answer, and in a stream Responses' `response.completed` →
  `response.usage`, Messages' `message_start` → `message.usage.input_tokens` plus the last
  `message_delta` → `usage.output_tokens`; embeddings report `usage.prompt_tokens` only;
- refusals and early stream ends in the family's dialect (`error_answer`, `stream_error`).
"""

from __future__ import annotations

import json
from typing import Any, Final

from gateway.core.body import RequestBody, Usage, opaque

CHAT: Final = "chat"
COMPLETIONS = "completions"
EMBEDDINGS: Final = "embeddings"
RESPONSES: Final = "responses"
MESSAGES: Final = "messages"
COUNT_TOKENS: Final = "count_tokens"  # Anthropic's dialect, passed through uncounted

FAMILIES = (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, MESSAGES)
OPENAI_CHUNKS = frozenset({CHAT, COMPLETIONS})  # read by `gateway.core.body`
ANTHROPIC: Final = frozenset({MESSAGES, COUNT_TOKENS})
TYPED_STREAMS = frozenset({RESPONSES, MESSAGES})  # streams of typed events, always read

_BY_PATH: Final = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
    "/v1/embeddings": EMBEDDINGS,
    "/v1/responses": RESPONSES,
    "/v1/messages": MESSAGES,
    "/v1/messages/count_tokens": COUNT_TOKENS,
}
# Longest ending first: `/chat/completions` before `/completions`.
_ENDINGS: Final = (
    ("/messages/count_tokens", COUNT_TOKENS),
    ("/chat/completions", CHAT),
    ("/completions", COMPLETIONS),
    ("/embeddings", EMBEDDINGS),
    ("/responses", RESPONSES),
    ("/messages", MESSAGES),
)


def by_path(path: str) -> str:
    """The family of a request path (`api: auto`); chat when the path names none."""
    api = _BY_PATH.get(path)
    if api is not None:
        return api
    p = path.rstrip("/")
    for ending, family in _ENDINGS:
        if p.endswith(ending):
            return family
    return CHAT


def resolve(route_api: str | None, path: str) -> str:
    """A request's family: its route's `api` (None = auto), else its path's."""
    if route_api is None:
        return by_path(path)
    if route_api == MESSAGES and path.rstrip("/").endswith("/count_tokens"):
        return COUNT_TOKENS
    return route_api


# --- the request ---------------------------------------------------------------------------


def read(api: str, raw: bytes, doc: Any) -> RequestBody:
    """A parsed body of a family that is not chat or text completions."""
    if not isinstance(doc, dict):
        b = opaque(len(raw), raw)
        b.api = api
        return b
    model = doc.get("model")
    mt: Any = None
    for key in ("max_output_tokens", "max_tokens", "max_completion_tokens"):
        mt = doc.get(key)
        if mt is not None:
            break
    if api in (EMBEDDINGS, COUNT_TOKENS):
        mt = 0  # nothing is generated: the prompt is the whole cost
    b = RequestBody(
        raw,
        len(raw),
        doc,
        model if isinstance(model, str) else None,
        mt if type(mt) is int and mt >= 0 else None,
        doc.get("stream") is True,
        None,
        prompt_chars(doc),
    )
    b.api = api
    return b


def prompt_chars(doc: dict[str, Any]) -> int:
    """Characters of prompt text in a Responses, Messages or embeddings request: `system`,
    `instructions`, `messages` and `input` (strings, lists of strings, content blocks, tool
    results and tool calls' arguments)."""
    n = 0
    for key in ("instructions", "system", "messages", "input", "prompt"):
        v = doc.get(key)
        if v is not None:
            n += text_chars(v, 0)
    return n


_TEXT_KEYS: Final = ("text", "content", "input", "output", "arguments", "thinking")


def text_chars(v: Any, depth: int) -> int:
    """Characters of the text in a value: a string, a list of them, or content blocks (their
    `text`, `content`, tool `input`/`output`/`arguments`); bounded nesting."""
    if isinstance(v, str):
        return len(v)
    if depth > 8:
        return 0
    if isinstance(v, list):
        return sum((text_chars(x, depth + 1) for x in v), 0)
    if isinstance(v, dict):
        n = 0
        for key in _TEXT_KEYS:
            x = v.get(key)
            if x is None:
                continue
            if isinstance(x, dict) and key == "input":  # a tool call's arguments (JSON)
                n += len(json.dumps(x, separators=(",", ":")))
            else:
                n += text_chars(x, depth + 1)
        return n
    return 0


# --- the answer ----------------------------------------------------------------------------


def _int(v: Any) -> int | None:
    return v if type(v) is int and v >= 0 else None


def usage_of(api: str, doc: Any, prev: Usage | None) -> Usage | None:
    """The usage a JSON answer or one stream event of the family reports (`prev`: what earlier
    events of the same stream reported); None when it reports none."""
    if not isinstance(doc, dict):
        return None
    if api == MESSAGES:
        return _messages_usage(doc, prev)
    if api == RESPONSES:
        r = doc.get("response")
        u = r.get("usage") if isinstance(r, dict) else doc.get("usage")
        if not isinstance(u, dict):
            return None
        i, o = _int(u.get("input_tokens")), _int(u.get("output_tokens"))
        return Usage(i, o) if i is not None and o is not None else None
    if api == EMBEDDINGS:
        u = doc.get("usage")
        if not isinstance(u, dict):
            return None
        p = _int(u.get("prompt_tokens"))
        if p is None:
            p = _int(u.get("total_tokens"))
        return Usage(p, 0) if p is not None else None
    return None  # count_tokens: nothing to count


def _messages_input(u: dict[str, Any]) -> int | None:
    """Anthropic's input: `input_tokens` plus the prompt-cache reads and writes it excludes."""
    i = _int(u.get("input_tokens"))
    if i is None:
        return None
    for k in ("cache_creation_input_tokens", "cache_read_input_tokens"):
        i += _int(u.get(k)) or 0
    return i


def _messages_usage(doc: dict[str, Any], prev: Usage | None) -> Usage | None:
    t = doc.get("type")
    if t == "message_start":
        m = doc.get("message")
        u = m.get("usage") if isinstance(m, dict) else None
        if not isinstance(u, dict):
            return None
        i = _messages_input(u)
        return Usage(i, _int(u.get("output_tokens")) or 0) if i is not None else None
    u = doc.get("usage")
    if not isinstance(u, dict):
        return None
    o = _int(u.get("output_tokens"))
    if t == "message_delta":  # cumulative output; input only where the server repeats it
        i = _messages_input(u)
        if i is None:
            i = prev.prompt_tokens if prev is not None else 0
        return Usage(i, o if o is not None else (prev.completion_tokens if prev else 0))
    i = _messages_input(u)  # a whole answer
    return Usage(i, o) if i is not None and o is not None else None


def is_output(doc: Any) -> bool:
    """An event of a Responses or Messages stream that carries output (a token, a tool call's
    arguments): what TTFT and the stream's event count are taken from."""
    if not isinstance(doc, dict):
        return False
    t = doc.get("type")
    return t == "content_block_delta" or (
        isinstance(t, str) and t.startswith("response.") and t.endswith(".delta")
    )


def output_chars(doc: Any) -> int:
    """Characters of output in one Responses or Messages stream event (0 for the others)."""
    if not isinstance(doc, dict):
        return 0
    d = doc.get("delta")
    if isinstance(d, str):  # response.output_text.delta, response.*_arguments.delta...
        return len(d) if doc.get("type", "").startswith("response.") else 0
    if isinstance(d, dict) and doc.get("type") == "content_block_delta":
        for k in ("text", "partial_json", "thinking"):
            x = d.get(k)
            if isinstance(x, str):
                return len(x)
    return 0


# --- refusals and early ends, in the family's dialect ----------------------------------------

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_status(status: int) -> int:
    """The status Anthropic's API answers where Sluice answers `status`: overload (queue full,
    shed, no capacity: 503) is its 529."""
    return 529 if status == 503 else status


def anthropic_type(status: int) -> str:
    t = _ANTHROPIC_TYPES.get(status)
    if t is not None:
        return t
    return "invalid_request_error" if status < 500 else "api_error"


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def error_answer(api: str, status: int, error_type: str, message: str) -> tuple[int, bytes]:
    """A refusal's status and JSON body in the family's dialect. OpenAI's families:
    `{"error": {"type", "message"}}` at `status`; Anthropic's: `{"type": "error", "error":
    {"type", "message"}}` with its own error type (Sluice's kept in the message) and status."""
    if api in ANTHROPIC:
        status = anthropic_status(status)
        text = f"{message} ({error_type})" if error_type else message
        err = {"type": anthropic_type(status), "message": text}
        return status, _dumps({"type": "error", "error": err})
    return status, _dumps({"error": {"type": error_type, "message": message}})


def stream_error(api: str, error_type: str, message: str) -> bytes | None:
    """The events that end a Responses or Messages stream that cannot finish (None for the
    OpenAI chunk families: `gateway.core.sse.error_event`). Messages: `event: error` (its
    client raises), then the stream closes. Responses: an `error` event, then
    `response.failed`."""
    if api in ANTHROPIC:
        kind = "overloaded_error" if error_type in _OVERLOAD else "api_error"
        doc = {"type": "error", "error": {"type": kind, "message": f"{message} ({error_type})"}}
        return b"event: error\ndata: " + _dumps(doc) + b"\n\n"
    if api == RESPONSES:
        err = {"type": "error", "code": error_type, "message": message, "param": None}
        failed = {
            "type": "response.failed",
            "response": {
                "object": "response",
                "status": "failed",
                "error": {"code": "server_error", "message": message},
            },
        }
        return (
            b"event: error\ndata: " + _dumps(err) + b"\n\n"
            b"event: response.failed\ndata: " + _dumps(failed) + b"\n\n"
        )
    return None


_OVERLOAD: Final = frozenset({"overloaded", "queue_full", "shed", "no_capacity"})
