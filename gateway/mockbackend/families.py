"""The simulated backend's other API families: OpenAI embeddings and Responses, Anthropic
Messages (and its `count_tokens`), beside chat and text completions (`gateway.mockbackend.http`).

Each answers as the real API does, JSON or SSE (`stream: true`), with exact usage: prompt
tokens by the backend's estimate (`estimate_tokens`), output tokens as many as it generated.
The knobs apply as to completions: pacing (`ttft_ms`, `token_delay_ms`, prefill), the model
list, the generation slots and the failures: `http_5xx`, `unavailable`, `hang`, `reset` (a
stream is cut after its first token), and before the first token of a stream
(`reset_before_first_token`, `error_event`: Messages' `event: error`, Responses'
`response.failed`, `stall_before_first_token`). Errors are in the family's dialect.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any

from aiohttp import web

from gateway.mockbackend.http import (
    EARLY_FAILURES,
    MODELS,
    STATE,
    BadRequest,
    error_response,
    prefill,
    read_json,
    record_headers,
    reset_connection,
)
from gateway.mockbackend.knobs import (
    Call,
    Knobs,
    completion_count,
    estimate_tokens,
    serves,
    token_text,
)

_ANTHROPIC_ERRORS = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large"}


def anthropic_error(status: int, message: str) -> web.Response:
    """Anthropic's error: {"type": "error", "error": {"type", "message"}}."""
    kind = _ANTHROPIC_ERRORS.get(status, "overloaded_error" if status == 529 else "api_error")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return web.json_response(body, status=status)


def _text_of(v: Any, depth: int = 0) -> str:
    """The prompt text of a value: strings, lists, content blocks (`text`, `content`, tool
    `input` as JSON, `output`); the backend's estimate counts these."""
    if isinstance(v, str):
        return v
    if depth > 8:
        return ""
    if isinstance(v, list):
        return "".join(_text_of(x, depth + 1) for x in v)
    if isinstance(v, dict):
        parts = []
        for k in ("text", "content", "input", "output", "arguments", "thinking"):
            x = v.get(k)
            if isinstance(x, dict) and k == "input":
                parts.append(json.dumps(x, separators=(",", ":")))
            elif x is not None:
                parts.append(_text_of(x, depth + 1))
        return "".join(parts)
    return ""


def _prompt(body: dict[str, Any], keys: tuple[str, ...]) -> str:
    return "".join(_text_of(body[k]) for k in keys if body.get(k) is not None)


def _sse(event: str, payload: dict[str, Any]) -> bytes:
    data = json.dumps(payload, separators=(",", ":")).encode()
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"


@dataclasses.dataclass(slots=True)
class _Job:
    model: str
    n: int
    prompt_tokens: int
    prompt: str
    knobs: Knobs
    ident: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:24])

    def text(self) -> str:
        return "".join(token_text(i) for i in range(self.n))

    @property
    def truncated(self) -> bool:
        return self.n < self.knobs.completion_tokens


class _Family:
    """One family's answers (JSON, stream events) and errors."""

    name = ""
    prompt_keys: tuple[str, ...] = ()
    cap_keys: tuple[str, ...] = ()

    def error(self, status: int, message: str) -> web.Response:
        kind = "server_error" if status >= 500 else "invalid_request_error"
        return error_response(status, message, kind)

    def full(self, job: _Job) -> dict[str, Any]:
        raise NotImplementedError

    def head(self, job: _Job) -> list[bytes]:
        """The events before the first token."""
        raise NotImplementedError

    def token(self, job: _Job, i: int) -> bytes:
        raise NotImplementedError

    def tail(self, job: _Job) -> list[bytes]:
        """The events after the last token (usage in them)."""
        raise NotImplementedError

    def failed(self, job: _Job) -> bytes:
        """What the backend sends when generation fails before the first token."""
        raise NotImplementedError


class _Responses(_Family):
    name = "responses"
    prompt_keys = ("instructions", "input")
    cap_keys = ("max_output_tokens",)

    def _response(self, job: _Job, status: str, done: bool) -> dict[str, Any]:
        r: dict[str, Any] = {
            "id": "resp_" + job.ident,
            "object": "response",
            "created_at": int(time.time()),
            "status": status,
            "model": job.model,
            "output": [],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": None,
        }
        if done:
            r["output"] = [self._item(job, job.text(), "completed")]
            r["usage"] = {
                "input_tokens": job.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": job.n,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": job.prompt_tokens + job.n,
            }
            if job.truncated:
                r["status"] = "incomplete"
                r["incomplete_details"] = {"reason": "max_output_tokens"}
        return r

    def _item(self, job: _Job, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": []}] if text else []
        return {
            "id": "msg_" + job.ident,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def full(self, job: _Job) -> dict[str, Any]:
        return self._response(job, "completed", True)

    def _ev(self, kind: str, seq: int, **fields: Any) -> bytes:
        return _sse(kind, {"type": kind, "sequence_number": seq, **fields})

    def head(self, job: _Job) -> list[bytes]:
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._ev("response.created", 0, response=self._response(job, "in_progress", False)),
            self._ev("response.in_progress", 1, response=self._response(job, "in_progress", False)),
            self._ev(
                "response.output_item.added", 2, output_index=0,
                item=self._item(job, "", "in_progress"),
            ),
            self._ev(
                "response.content_part.added", 3, item_id="msg_" + job.ident, output_index=0,
                content_index=0, part=part,
            ),
        ]  # fmt: skip

    def token(self, job: _Job, i: int) -> bytes:
        return self._ev(
            "response.output_text.delta", 4 + i, item_id="msg_" + job.ident, output_index=0,
            content_index=0, delta=token_text(i), logprobs=[],
        )  # fmt: skip

    def tail(self, job: _Job) -> list[bytes]:
        seq = 4 + job.n
        text = job.text()
        part = {"type": "output_text", "text": text, "annotations": []}
        final = self._response(job, "completed", True)
        last = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return [
            self._ev(
                "response.output_text.done", seq, item_id="msg_" + job.ident, output_index=0,
                content_index=0, text=text, logprobs=[],
            ),
            self._ev(
                "response.content_part.done", seq + 1, item_id="msg_" + job.ident,
                output_index=0, content_index=0, part=part,
            ),
            self._ev(
                "response.output_item.done", seq + 2, output_index=0,
                item=self._item(job, text, "completed"),
            ),
            self._ev(last, seq + 3, response=final),
        ]  # fmt: skip

    def failed(self, job: _Job) -> bytes:
        r = self._response(job, "failed", False)
        r["error"] = {"code": "server_error", "message": "mock failure"}
        return self._ev("response.failed", 4, response=r)


class _Messages(_Family):
    name = "messages"
    prompt_keys = ("system", "messages")
    cap_keys = ("max_tokens",)

    def error(self, status: int, message: str) -> web.Response:
        return anthropic_error(529 if status == 503 else status, message)

    def _message(self, job: _Job, done: bool) -> dict[str, Any]:
        stop = ("max_tokens" if job.truncated else "end_turn") if done else None
        return {
            "id": "msg_" + job.ident,
            "type": "message",
            "role": "assistant",
            "model": job.model,
            "content": [{"type": "text", "text": job.text()}] if done else [],
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": {"input_tokens": job.prompt_tokens, "output_tokens": job.n if done else 1},
        }

    def full(self, job: _Job) -> dict[str, Any]:
        return self._message(job, True)

    def head(self, job: _Job) -> list[bytes]:
        return [
            _sse("message_start", {"type": "message_start", "message": self._message(job, False)}),
            _sse(
                "content_block_start",
                {"type": "content_block_start", "index": 0,
                 "content_block": {"type": "text", "text": ""}},
            ),
            _sse("ping", {"type": "ping"}),
        ]  # fmt: skip

    def token(self, job: _Job, i: int) -> bytes:
        delta = {"type": "text_delta", "text": token_text(i)}
        return _sse(
            "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
        )

    def tail(self, job: _Job) -> list[bytes]:
        stop = "max_tokens" if job.truncated else "end_turn"
        return [
            _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
            _sse(
                "message_delta",
                {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                 "usage": {"output_tokens": job.n}},
            ),
            _sse("message_stop", {"type": "message_stop"}),
        ]  # fmt: skip

    def failed(self, job: _Job) -> bytes:
        err = {"type": "overloaded_error", "message": "mock failure"}
        return _sse("error", {"type": "error", "error": err})


RESPONSES, MESSAGES = _Responses(), _Messages()


async def _inject(fam: _Family, knobs: Knobs, state: Any, call: Call) -> web.Response | None:
    if knobs.failure == "hang":
        await asyncio.Event().wait()
    if knobs.failure == "http_5xx" or (knobs.failure == "none" and state.draw_error()):
        call.fail()
        return fam.error(knobs.error_status, "mock failure")
    if knobs.failure == "unavailable":
        call.fail()
        return fam.error(503, "mock backend unavailable")
    return None


async def _accept(
    request: web.Request, fam: _Family, call: Call
) -> tuple[dict[str, Any], Knobs] | web.Response:
    """The request's JSON body and this request's snapshot of the knobs, or the family's error
    (a bad body, a model the backend does not serve)."""
    try:
        body = await read_json(request)
    except BadRequest as exc:
        call.fail()
        return fam.error(exc.status, exc.message)
    knobs = dataclasses.replace(request.app[STATE].knobs)
    model = body.get("model")
    if not serves(knobs, model):
        call.fail()
        return fam.error(404, f"The model `{model}` does not exist.")
    return body, knobs


async def _generate(request: web.Request, fam: _Family) -> web.StreamResponse:
    state = request.app[STATE]
    record_headers(state, request)
    with state.stats.track(f"{request.method} {request.path}") as call:
        got = await _accept(request, fam, call)
        if isinstance(got, web.Response):
            return got
        body, knobs = got
        model = body.get("model")
        cap = next((body[k] for k in fam.cap_keys if body.get(k) is not None), None)
        prompt = _prompt(body, fam.prompt_keys)
        job = _Job(
            model if isinstance(model, str) and model else MODELS[0],
            completion_count(knobs, cap),
            estimate_tokens(prompt),
            prompt,
            knobs,
        )
        async with state.slots.hold(knobs):
            failure = await _inject(fam, knobs, state, call)
            if failure is not None:
                return failure
            if body.get("stream") is True:
                return await _stream(request, fam, job, call)
            await prefill(state.cache, prompt, knobs)
            await asyncio.sleep(knobs.token_delay_ms * max(job.n - 1, 0) / 1000)
            if knobs.failure == "reset":
                reset_connection(request, call)
                return web.Response()
            return web.json_response(fam.full(job))


async def _stream(request: web.Request, fam: _Family, job: _Job, call: Call) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    await resp.write(b"".join(fam.head(job)))
    failure = job.knobs.failure
    if failure in EARLY_FAILURES:
        call.fail()
        if failure == "stall_before_first_token":
            await asyncio.Event().wait()
        if failure == "error_event":
            await resp.write(fam.failed(job))
            await resp.write_eof()
            return resp
        reset_connection(request, call)
        return resp
    await prefill(request.app[STATE].cache, job.prompt, job.knobs)
    for i in range(job.n):
        if i:
            await asyncio.sleep(job.knobs.token_delay_ms / 1000)
        await resp.write(fam.token(job, i))
        if failure == "reset":  # mid-response: after the first token
            reset_connection(request, call)
            return resp
    await resp.write(b"".join(fam.tail(job)))
    await resp.write_eof()
    return resp


async def responses(request: web.Request) -> web.StreamResponse:
    return await _generate(request, RESPONSES)


async def messages(request: web.Request) -> web.StreamResponse:
    return await _generate(request, MESSAGES)


async def count_tokens(request: web.Request) -> web.Response:
    """Anthropic's `POST /v1/messages/count_tokens`: the prompt's tokens, nothing generated."""
    state = request.app[STATE]
    record_headers(state, request)
    with state.stats.track("POST /v1/messages/count_tokens") as call:
        try:
            body = await read_json(request)
        except BadRequest as exc:
            call.fail()
            return anthropic_error(exc.status, exc.message)
        return web.json_response(
            {"input_tokens": estimate_tokens(_prompt(body, MESSAGES.prompt_keys))}
        )


async def embeddings(request: web.Request) -> web.Response:
    """OpenAI's `POST /v1/embeddings`: one small vector per input, usage.prompt_tokens."""
    state = request.app[STATE]
    record_headers(state, request)
    with state.stats.track("POST /v1/embeddings") as call:
        fam = _Family()
        got = await _accept(request, fam, call)
        if isinstance(got, web.Response):
            return got
        body, knobs = got
        model = body.get("model")
        inp = body.get("input")
        items = inp if isinstance(inp, list) and inp and not isinstance(inp[0], int) else [inp]
        if not all(isinstance(x, str | list) for x in items):
            call.fail()
            return fam.error(400, "'input' must be a string or a list of strings")
        failure = await _inject(fam, knobs, state, call)
        if failure is not None:
            return failure
        await asyncio.sleep(knobs.ttft_ms / 1000)
        tokens = sum(estimate_tokens(x) if isinstance(x, str) else len(x or ()) for x in items)
        data = [
            {"object": "embedding", "index": i, "embedding": [0.0, 0.5, 1.0, float(i)]}
            for i in range(len(items))
        ]
        return web.json_response(
            {
                "object": "list",
                "data": data,
                "model": model if isinstance(model, str) and model else MODELS[0],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )


def add_family_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
