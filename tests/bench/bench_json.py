"""`python -m tests.bench.bench_json`: json against orjson for what Sluice parses per request.

- the body phase: `loads` of an OpenAI chat request of about 1 KB, 10 KB, 100 KB and 1 MB
  (a conversation of user/assistant messages), plus `dumps` of it (a rewrite such as
  `stream_options.include_usage` re-serialises the body);
- the response phase: `loads` of one small streamed chunk (`chat.completion.chunk` with one
  token), as done per SSE event, and of the final usage chunk.

Each case runs for about `--seconds` (best of 5 timed batches); figures are µs per call on this
machine, on the core the process runs on. orjson missing: its columns say so.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - measured where it is installed
    orjson = None  # type: ignore[assignment]

WORDS = "the quick brown fox jumps over the lazy dog while a model streams tokens to the client "


def chat_request(size: int) -> bytes:
    """An OpenAI chat request body of about `size` bytes."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    body: dict[str, Any] = {
        "model": "llama-3.1-8b-instruct",
        "messages": messages,
        "max_tokens": 512,
        "temperature": 0.7,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    i = 0
    while len(json.dumps(body)) < size:
        role = "user" if i % 2 == 0 else "assistant"
        messages.append({"role": role, "content": (WORDS * 3)[: 120 + (i * 37) % 200]})
        i += 1
    return json.dumps(body).encode()


CHUNK = json.dumps(
    {
        "id": "chatcmpl-8f2c1e",
        "object": "chat.completion.chunk",
        "created": 1733000000,
        "model": "llama-3.1-8b-instruct",
        "choices": [{"index": 0, "delta": {"content": " token"}, "finish_reason": None}],
    }
).encode()
USAGE = json.dumps(
    {
        "id": "chatcmpl-8f2c1e",
        "object": "chat.completion.chunk",
        "created": 1733000000,
        "model": "llama-3.1-8b-instruct",
        "choices": [],
        "usage": {"prompt_tokens": 812, "completion_tokens": 256, "total_tokens": 1068},
    }
).encode()


def per_call_us(fn: Callable[[], object], seconds: float) -> float:
    """Best of 5 batches, each sized to take about seconds / 5."""
    n, t = 1, 0.0
    while t < 0.01:  # calibrate
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t = time.perf_counter() - t0
        n *= 2
    n = max(1, int(n / 2 * (seconds / 5) / t))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="time per case")
    args = parser.parse_args()
    cases: list[tuple[str, bytes]] = [
        (f"chat request {label}", chat_request(size))
        for label, size in (("1 KB", 1024), ("10 KB", 10240), ("100 KB", 102400), ("1 MB", 1 << 20))
    ]
    cases += [("SSE chunk (one token)", CHUNK), ("SSE usage chunk", USAGE)]
    have = orjson is not None
    print(f"{'case':28}{'bytes':>9}{'json loads':>12}{'orjson':>10}{'×':>6}"
          f"{'json dumps':>12}{'orjson':>10}{'×':>6}   (µs per call)")  # fmt: skip
    for name, raw in cases:
        doc = json.loads(raw)
        jl = per_call_us(lambda r=raw: json.loads(r), args.seconds)
        jd = per_call_us(lambda d=doc: json.dumps(d, separators=(",", ":")).encode(), args.seconds)
        if have:
            ol = per_call_us(lambda r=raw: orjson.loads(r), args.seconds)
            od = per_call_us(lambda d=doc: orjson.dumps(d), args.seconds)
            print(f"{name:28}{len(raw):>9}{jl:>12.2f}{ol:>10.2f}{jl / ol:>6.1f}"
                  f"{jd:>12.2f}{od:>10.2f}{jd / od:>6.1f}")  # fmt: skip
        else:
            print(f"{name:28}{len(raw):>9}{jl:>12.2f}{'—':>10}{'':>6}{jd:>12.2f}{'—':>10}")


if __name__ == "__main__":
    main()
