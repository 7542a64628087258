"""OpenAI-compatible HTTP face of the simulated backend (aiohttp): chat and text completions,
plain JSON or SSE streams paced by the knobs, and the model list. Admin, health and metrics
routes live in `gateway.mockbackend.admin`; all share one `MockState` through `STATE`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any

from aiohttp import web

from gateway.mockbackend.knobs import (
    MAX_MODELS,
    Call,
    Knobs,
    MockState,
    Seen,
    completion_count,
    estimate_tokens,
    serves,
    token_text,
)
from gateway.mockbackend.prefix_cache import PrefixCache

STATE = web.AppKey("mock_state", MockState)
MAX_BODY = 1 << 20  # request body limit (bytes); larger bodies get 413
MODELS = ("mock-model", "mock-llama-3-8b", "mock-qwen-2.5-7b")

_DONE = b"data: [DONE]\n\n"


def error_response(status: int, message: str, kind: str) -> web.Response:
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}}."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return web.json_response(body, status=status)


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def record_headers(state: MockState, request: web.BaseRequest) -> None:
    """Remember the request id and the header names the caller sent, never a value."""
    state.stats.seen.append(Seen.of(request.headers.items()))


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise BadRequest(413, f"request body larger than {MAX_BODY} bytes") from exc
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object")
    return body


def _prompt_text(body: dict[str, Any], chat: bool) -> str:
    """The text the prompt token estimate is taken from."""
    if not chat:
        prompt = body.get("prompt", "")
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            return "".join(prompt)
        raise BadRequest(400, "'prompt' must be a string or a list of strings")
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise BadRequest(400, "'messages' must be a list of objects")
    parts: list[str] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts.extend(p["text"] for p in content if isinstance(p, dict) and "text" in p)
    return "".join(parts)


async def prefill(cache: PrefixCache, text: str, knobs: Knobs) -> None:
    """Wait as long as the prompt's prefill takes (see the module docstring)."""
    uncached = cache.lookup(text, knobs.prefix_block_chars, knobs.prefix_cache_blocks)
    seconds = (knobs.ttft_ms + knobs.uncached_token_ms * uncached / 4) / 1000
    slots = cache.slots(knobs.prefill_slots)
    if slots is None:
        await asyncio.sleep(seconds)
        return
    async with slots:
        await asyncio.sleep(seconds)


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


@dataclasses.dataclass(slots=True)
class _Completion:
    """What one completion request asked for, and the knobs it runs under (a snapshot)."""

    chat: bool
    model: str
    n: int
    prompt_tokens: int
    knobs: Knobs
    prompt: str = ""
    ident: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def finish_reason(self) -> str:
        return "length" if self.n < self.knobs.completion_tokens else "stop"

    def usage(self) -> dict[str, int]:
        total = self.prompt_tokens + self.n
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.n,
            "total_tokens": total,
        }

    def envelope(self, chunk: bool) -> dict[str, Any]:
        prefix, obj = (
            ("chatcmpl-", "chat.completion") if self.chat else ("cmpl-", "text_completion")
        )
        if chunk and self.chat:
            obj += ".chunk"
        return {
            "id": prefix + self.ident,
            "object": obj,
            "created": self.created,
            "model": self.model,
        }

    def text(self) -> str:
        return "".join(token_text(i) for i in range(self.n))

    def full(self) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": self.text()}
        else:
            choice |= {"text": self.text(), "logprobs": None}
        return self.envelope(False) | {"choices": [choice], "usage": self.usage()}

    def preamble(self, include_usage: bool) -> dict[str, Any]:
        """The role-only chunk a chat stream may start with (no token)."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": None}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": ""}
        else:
            choice |= {"text": "", "logprobs": None}
        out = self.envelope(True) | {"choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    def chunk(self, index: int | None, include_usage: bool) -> dict[str, Any]:
        """Token `index`'s chunk, or (index None) the chunk carrying finish_reason."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": None}
        text = "" if index is None else token_text(index)
        if self.chat:
            choice["delta"] = {} if index is None else {"content": text}
            if index == 0:
                choice["delta"]["role"] = "assistant"
        else:
            choice |= {"text": text, "logprobs": None}
        if index is None:
            choice["finish_reason"] = self.finish_reason
        out = self.envelope(True) | {"choices": [choice]}
        if include_usage:  # as OpenAI: every chunk has "usage": null, the last one the numbers
            out["usage"] = None
        return out


async def _inject(state: MockState, job: _Completion, call: Call) -> web.StreamResponse | None:
    """Apply the failure knobs; a response means 'answer this instead'."""
    knobs = job.knobs
    if knobs.failure == "hang":
        await asyncio.Event().wait()  # until the client goes away or the server shuts down
    if knobs.failure == "http_5xx" or (knobs.failure == "none" and state.draw_error()):
        call.fail()
        return error_response(knobs.error_status, "mock failure", "server_error")
    if knobs.failure == "unavailable":
        call.fail()
        return error_response(503, "mock backend unavailable", "server_error")
    return None


def reset_connection(request: web.Request, call: Call) -> None:
    """Drop the TCP connection without a proper end (the `reset` failure)."""
    call.fail()
    if request.transport is not None:
        request.transport.abort()


async def _complete(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    record_headers(state, request)
    with state.stats.track(f"{request.method} {request.path}") as call:
        try:
            body = await read_json(request)
            prompt = _prompt_text(body, chat)
        except BadRequest as exc:
            call.fail()
            return error_response(exc.status, exc.message, "invalid_request_error")
        knobs = dataclasses.replace(state.knobs)  # this request's snapshot
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        model = body.get("model")
        loadable = knobs.load_adapters and len(knobs.adapters) < MAX_MODELS
        if not serves(knobs, model) and loadable and isinstance(model, str):
            state.knobs.adapters[model[:256]] = knobs.models[0]  # loaded on demand
        elif not serves(knobs, model):  # vLLM's answer
            call.fail()
            return error_response(404, f"The model `{model}` does not exist.", "NotFoundError")
        job = _Completion(
            chat=chat,
            model=model if isinstance(model, str) and model else MODELS[0],
            n=completion_count(knobs, max_tokens),
            prompt_tokens=estimate_tokens(prompt),
            knobs=knobs,
            prompt=prompt,
        )
        async with state.slots.hold(knobs):
            failure = await _inject(state, job, call)
            if failure is not None:
                return failure
            if body.get("stream") is True:
                options = body.get("stream_options")
                include_usage = isinstance(options, dict) and options.get("include_usage") is True
                return await _stream(request, job, call, include_usage)
            await prefill(state.cache, prompt, knobs)
            await asyncio.sleep(knobs.token_delay_ms * max(job.n - 1, 0) / 1000)
            if knobs.failure == "reset":
                reset_connection(request, call)
                return web.Response()
            return web.json_response(job.full())


async def _stream(
    request: web.Request, job: _Completion, call: Call, include_usage: bool
) -> web.StreamResponse:
    """SSE: headers at once, the first token after ttft, then one chunk per token delay."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    failure = job.knobs.failure
    if job.knobs.role_preamble or failure in EARLY_FAILURES:
        await resp.write(_sse(job.preamble(include_usage)))
    if failure in EARLY_FAILURES:
        return await _fail_early(request, resp, call, failure)
    await prefill(request.app[STATE].cache, job.prompt, job.knobs)
    for i in range(job.n):
        if i:
            await asyncio.sleep(job.knobs.token_delay_ms / 1000)
        await resp.write(_sse(job.chunk(i, include_usage)))
        if job.knobs.failure == "reset":  # mid-response: after the first token
            break
    if job.knobs.failure == "reset":
        reset_connection(request, call)
        return resp
    await resp.write(_sse(job.chunk(None, include_usage)))
    if include_usage:
        await resp.write(_sse(job.envelope(True) | {"choices": [], "usage": job.usage()}))
    await resp.write(_DONE)
    await resp.write_eof()
    return resp


EARLY_FAILURES = ("reset_before_first_token", "error_event", "stall_before_first_token")


async def _fail_early(
    request: web.Request, resp: web.StreamResponse, call: Call, failure: str
) -> web.StreamResponse:
    """A stream that fails after its head and role-only chunk, before any token."""
    call.fail()
    if failure == "stall_before_first_token":
        await asyncio.Event().wait()  # until the client goes away
    if failure == "error_event":  # what vLLM sends when generation fails
        err = {"error": {"message": "mock failure", "type": "InternalServerError", "code": 500}}
        await resp.write(_sse(err) + _DONE)
        await resp.write_eof()
        return resp
    reset_connection(request, call)
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=False)


async def models(request: web.Request) -> web.Response:
    """The model list as vLLM gives it: base models (`parent` null), then the LoRA adapters
    with their parent."""
    state = request.app[STATE]
    record_headers(state, request)
    with state.stats.track("GET /v1/models") as call:
        created = int(time.time())
        knobs = state.knobs
        if knobs.failure == "http_5xx":  # a server failing everything fails its listing too
            call.fail()
            return error_response(knobs.error_status, "mock failure", "server_error")
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": "sluice", "root": m,
             "parent": None}
            for m in (knobs.models or MODELS)
        ]  # fmt: skip
        data += [
            {"id": a, "object": "model", "created": created, "owned_by": "sluice", "root": a,
             "parent": p}
            for a, p in knobs.adapters.items()
        ]  # fmt: skip
        return web.json_response({"object": "list", "data": data})


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    rid = request.headers.get("x-request-id")
    if rid is not None:
        response.headers["x-request-id"] = rid
