"""(compiled) The request body as the chain sees it in the body phase, and LLM token usage.

Pure: the forwarding path reads the body (up to the policy's `body.max_json_bytes`), parses it
and hands a `RequestBody` to the filters' `on_body`. Bodies that are larger, not JSON or
malformed are `opaque`: fields are unknown, `size` comes from Content-Length, and the bytes
pass through unchanged. A filter may rewrite a parsed body (`set`); the forwarding path then
serialises it again before it goes upstream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

CHARS_PER_TOKEN: Final = 4  # the usual estimate for English text: prompt bytes / 4


class RequestBody:
    """A plain class with its own `__init__`: compiled, it is built without a Python frame (a
    dataclass's generated `__init__` runs interpreted: ~0.4 µs a request)."""

    __slots__ = ("raw", "size", "doc", "model", "max_tokens", "stream", "stream_options",
                 "prompt_chars", "dirty", "usage_added", "changes", "api")  # fmt: skip

    def __init__(
        self,
        raw: bytes,  # as received; b"" when the body was not read (too large: it streams)
        size: int,  # bytes: len(raw), or Content-Length (0 when unknown) for an unread body
        doc: dict[str, Any] | None = None,  # the parsed JSON object; None for an opaque body
        model: str | None = None,
        max_tokens: int | None = None,  # max_tokens, else max_completion_tokens
        stream: bool = False,
        stream_options: dict[str, Any] | None = None,
        prompt_chars: int = 0,  # characters of prompt text; the body size when unknown
    ) -> None:
        self.raw = raw
        self.size = size
        self.doc = doc
        self.model = model
        self.max_tokens = max_tokens
        self.stream = stream
        self.stream_options = stream_options
        self.prompt_chars = prompt_chars
        self.dirty = False  # a filter changed `doc`: serialise it again before forwarding
        self.usage_added = False  # Sluice asked the backend for usage the client did not ask for
        self.changes: dict[str, Any] | None = None  # the top-level fields `set` rewrote
        self.api = "chat"  # its API family (`gateway.core.apis`); chat and completions read alike

    def __repr__(self) -> str:
        return (
            f"RequestBody(size={self.size}, api={self.api!r}, model={self.model!r}, "
            f"max_tokens={self.max_tokens}, stream={self.stream}, parsed={self.doc is not None})"
        )

    @property
    def parsed(self) -> bool:
        return self.doc is not None

    @property
    def prompt_tokens_estimate(self) -> int:
        return (self.prompt_chars + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN

    def set(self, key: str, value: Any) -> None:
        """Rewrite one top-level field of a parsed body (no-op on an opaque body)."""
        if self.doc is None:
            return
        self.doc[key] = value
        self.dirty = True
        if self.changes is None:
            self.changes = {}
        self.changes[key] = value
        if key == "stream_options":
            self.stream_options = value if isinstance(value, dict) else None

    @property
    def wants_usage(self) -> bool:
        """A streaming request whose client asked for the final usage chunk."""
        opts = self.stream_options
        return bool(opts and opts.get("include_usage") is True)


def opaque(size: int, raw: bytes = b"") -> RequestBody:
    """A body the gateway did not understand: sizes only."""
    return RequestBody(raw, size, prompt_chars=size)


def from_doc(raw: bytes, doc: Any) -> RequestBody:
    """Fields of an OpenAI-style request (chat or text completion); anything else is opaque."""
    if not isinstance(doc, dict):
        return opaque(len(raw), raw)
    model = doc.get("model")
    mt = doc.get("max_tokens")
    if mt is None:
        mt = doc.get("max_completion_tokens")
    opts = doc.get("stream_options")
    size = len(raw)
    return RequestBody(  # positional: ~0.25 µs less than by keyword (the fields' order)
        raw,
        size,
        doc,
        model if isinstance(model, str) else None,
        mt if type(mt) is int and mt >= 0 else None,
        doc.get("stream") is True,
        opts if isinstance(opts, dict) else None,
        _prompt_chars(doc, size),
    )


def _prompt_chars(doc: dict[str, Any], fallback: int) -> int:
    messages = doc.get("messages")
    if isinstance(messages, list):
        n = 0
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                n += len(content)
            elif isinstance(content, list):  # content parts: count the text ones
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        n += len(part["text"])
        return n
    prompt = doc.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum((len(p) for p in prompt if isinstance(p, str)), 0)
    return fallback


class Usage:
    """Tokens a backend reports for one request (OpenAI `usage`), made once per answer on the
    request path: a plain class (compiled, built without a Python frame; a named tuple's
    `__new__` runs interpreted), compared by value."""

    __slots__ = ("prompt_tokens", "completion_tokens")

    def __init__(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Usage):
            return NotImplemented
        return (
            self.prompt_tokens == other.prompt_tokens
            and self.completion_tokens == other.completion_tokens
        )

    def __hash__(self) -> int:
        return hash((self.prompt_tokens, self.completion_tokens))

    def __repr__(self) -> str:
        return f"Usage({self.prompt_tokens}, {self.completion_tokens})"


def usage_from(doc: Any) -> Usage | None:
    """`usage` of an OpenAI-style response or final stream chunk, if it carries one."""
    if not isinstance(doc, dict):
        return None
    return usage_in(doc.get("usage"))


def usage_in(u: Any) -> Usage | None:
    """The counts of a parsed `usage` object (None: not one, or its counts missing)."""
    if not isinstance(u, dict):
        return None
    p, c = u.get("prompt_tokens"), u.get("completion_tokens")
    if type(p) is not int or type(c) is not int or p < 0 or c < 0:
        return None
    return Usage(p, c)


_USAGE_KEY: Final = b'"usage"'
_SPACE: Final = b" \t\r\n"
_MAX_USAGE_BYTES: Final = 4096  # a usage object is ~100 bytes; past this, parse the answer
_MAX_TAIL_BYTES: Final = 8192  # searched for it at the end of the answer (a long one: not all)


def _object_end(raw: bytes, j: int, end: int) -> int:
    """Past the `}` that closes the object opening at `raw[j]`, braces counted outside strings;
    -1 when it does not close before `end`."""
    depth = 0
    in_str = esc = False
    for k in range(j, end):
        c = raw[k]
        if in_str:
            if esc:
                esc = False
            elif c == 0x5C:  # a backslash
                esc = True
            elif c == 0x22:  # '"'
                in_str = False
        elif c == 0x22:
            in_str = True
        elif c == 0x7B:  # "{"
            depth += 1
        elif c == 0x7D:  # "}"
            depth -= 1
            if depth == 0:
                return k + 1
    return -1


def usage_tail(raw: bytes, loads: Callable[[bytes], Any]) -> Usage | None:
    """The `usage` of a whole JSON answer read from the few bytes at its end, where servers
    write it (last, or followed by a few scalar fields: vLLM's nulls), without parsing the
    answer: only the usage object and what follows it are parsed (`loads`: None for what does
    not parse). None: not found so (the caller parses the whole answer; the result is then the
    same for a valid answer).

    Why what is found is the top-level `usage`:
    - `"usage"` not preceded by a backslash and followed by `:` is a key (in a string, a quote
      followed by `usage"` and a colon cannot be valid JSON);
    - its value is the object from its `{` to the `}` that closes it (braces counted outside
      strings), and parses as one; or, when it is likely the last member (a `}` before the
      answer's own), what lies between its `{` and the answer's last `}` parses as one object
      (one parse, no counting): then nothing follows it;
    - what follows is the answer's closing `}`, or more members and it (parsed as an object):
      the object holding the key closes where the answer ends, so it is the outermost one.
    A later `usage` nested deeper is found first and fails the last test: the whole answer
    is parsed then."""
    end = len(raw)
    while end and raw[end - 1] in _SPACE:
        end -= 1
    if end < 2 or raw[end - 1] != 0x7D:  # "}"
        return None
    i = raw.rfind(_USAGE_KEY, max(0, end - _MAX_TAIL_BYTES), end)
    if i <= 0 or raw[i - 1] == 0x5C:  # a backslash: inside a string
        return None
    j = _past_space(raw, i + len(_USAGE_KEY), end)
    if j >= end or raw[j] != 0x3A:  # ":"
        return None
    j = _past_space(raw, j + 1, end)
    if j >= end or raw[j] != 0x7B:  # "{"
        return None
    last = end - 1  # the answer's closing "}"
    while last > j and raw[last - 1] in _SPACE:
        last -= 1
    if raw[last - 1] == 0x7D and last - j <= _MAX_USAGE_BYTES:
        # Likely the last member (OpenAI's and most servers' order): what lies between its
        # "{" and the answer's closing "}" is one object, or not (then counted out below).
        parsed = loads(raw[j:last])
        if parsed is not None:
            return usage_in(parsed)
    k = _object_end(raw, j, min(end - 1, j + _MAX_USAGE_BYTES))
    if k < 0:
        return None
    u = usage_in(loads(raw[j:k]))
    if u is None:
        return None
    rest = _past_space(raw, k, end)
    if rest == end - 1:  # the last member
        return u
    # Else members follow ("," first), and the closing "}": they parse as an object.
    more = raw[rest] == 0x2C and isinstance(loads(b"{" + raw[rest + 1 : end]), dict)
    return u if more else None


def _past_space(raw: bytes, j: int, end: int) -> int:
    while j < end and raw[j] in _SPACE:
        j += 1
    return j


_JSON_SEEN: Final[dict[str, bool]] = {}  # Content-Type value → is_json_type (bounded)
_MAX_SEEN: Final = 256


def is_json_type(content_type: str | None) -> bool:
    """Whether a request body of this Content-Type is worth parsing as JSON (remembered per
    distinct value: clients send a handful)."""
    if content_type is None:
        return True  # many clients omit it; a body that does not parse stays opaque
    known = _JSON_SEEN.get(content_type)
    if known is not None:
        return known
    low = content_type.lower().encode("latin-1", "replace")
    known = b"application/json" in low or b"text/json" in low or b"+json" in low
    if len(_JSON_SEEN) < _MAX_SEEN:
        _JSON_SEEN[content_type] = known
    return known
