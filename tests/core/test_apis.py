"""The API families: recognised by path, their requests and answers read, errors in dialect."""

from __future__ import annotations

import json

import pytest

from gateway.core import apis
from gateway.core.body import Usage
from gateway.core.first_token import Seen, classify_doc
from gateway.core.tokens import Reservation, chunk_tokens


@pytest.mark.parametrize(
    ("path", "family"),
    [
        ("/v1/chat/completions", apis.CHAT),
        ("/v1/completions", apis.COMPLETIONS),
        ("/v1/embeddings", apis.EMBEDDINGS),
        ("/v1/responses", apis.RESPONSES),
        ("/v1/messages", apis.MESSAGES),
        ("/v1/messages/count_tokens", apis.COUNT_TOKENS),
        ("/anthropic/v1/messages", apis.MESSAGES),
        ("/openai/v1/chat/completions/", apis.CHAT),
        ("/v1/models", apis.CHAT),
    ],
)
def test_family_by_path(path: str, family: str) -> None:
    assert apis.by_path(path) == family
    assert apis.resolve(None, path) == family


def test_route_override_wins_but_count_tokens_stays_uncounted() -> None:
    assert apis.resolve(apis.MESSAGES, "/llm") == apis.MESSAGES
    assert apis.resolve(apis.RESPONSES, "/v1/chat/completions") == apis.RESPONSES
    assert apis.resolve(apis.MESSAGES, "/llm/count_tokens") == apis.COUNT_TOKENS


def _read(api: str, doc: object) -> apis.RequestBody:
    raw = json.dumps(doc).encode()
    return apis.read(api, raw, doc)


def test_messages_request() -> None:
    b = _read(
        apis.MESSAGES,
        {
            "model": "claude-x",
            "max_tokens": 64,
            "stream": True,
            "system": [{"type": "text", "text": "abcd"}],
            "messages": [
                {"role": "user", "content": "12345678"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"a": 1}}],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t", "content": "result"},
                        {"type": "text", "text": "ok"},
                    ],
                },
            ],
        },
    )
    assert (b.model, b.max_tokens, b.stream, b.api) == ("claude-x", 64, True, apis.MESSAGES)
    # system 4 + user 8 + tool input {"a":1} 7 + tool result 6 + text 2
    assert b.prompt_chars == 4 + 8 + 7 + 6 + 2
    assert b.prompt_tokens_estimate == 7


def test_responses_request() -> None:
    b = _read(
        apis.RESPONSES,
        {
            "model": "gpt-x",
            "instructions": "be brief",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
                {"type": "function_call_output", "call_id": "c", "output": "42"},
            ],
            "max_output_tokens": 100,
        },
    )
    assert (b.model, b.max_tokens, b.stream) == ("gpt-x", 100, False)
    assert b.prompt_chars == 8 + 5 + 2
    assert _read(apis.RESPONSES, {"input": "plain"}).prompt_chars == 5


def test_embeddings_and_count_tokens_reserve_no_output() -> None:
    b = _read(apis.EMBEDDINGS, {"model": "e", "input": ["abcd", "efgh"]})
    assert (b.max_tokens, b.prompt_chars) == (0, 8)
    c = _read(apis.COUNT_TOKENS, {"model": "m", "max_tokens": 9, "messages": []})
    assert c.max_tokens == 0
    assert apis.read(apis.MESSAGES, b"[]", []).doc is None  # not an object: opaque


def test_usage_of_json_answers() -> None:
    assert apis.usage_of(
        apis.RESPONSES, {"usage": {"input_tokens": 3, "output_tokens": 5, "total_tokens": 8}}, None
    ) == Usage(3, 5)
    assert apis.usage_of(
        apis.MESSAGES,
        {"type": "message", "usage": {"input_tokens": 3, "output_tokens": 5}},
        None,
    ) == Usage(3, 5)
    cached = {"input_tokens": 3, "cache_read_input_tokens": 10, "output_tokens": 1}
    assert apis.usage_of(apis.MESSAGES, {"usage": cached}, None) == Usage(13, 1)
    assert apis.usage_of(
        apis.EMBEDDINGS, {"usage": {"prompt_tokens": 7, "total_tokens": 7}}, None
    ) == Usage(7, 0)
    assert apis.usage_of(apis.EMBEDDINGS, {"usage": {"prompt_tokens": -1}}, None) is None
    assert apis.usage_of(apis.RESPONSES, {"usage": {"input_tokens": 3}}, None) is None
    assert apis.usage_of(apis.COUNT_TOKENS, {"input_tokens": 3}, None) is None


def test_usage_of_streams() -> None:
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 9, "output_tokens": 1}}}
    u = apis.usage_of(apis.MESSAGES, start, None)
    assert u == Usage(9, 1)
    u = apis.usage_of(apis.MESSAGES, {"type": "message_delta", "usage": {"output_tokens": 4}}, u)
    assert u == Usage(9, 4)
    u = apis.usage_of(apis.MESSAGES, {"type": "message_delta", "usage": {"output_tokens": 6}}, u)
    assert u == Usage(9, 6)
    delta = {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "hi"}}
    assert apis.usage_of(apis.MESSAGES, delta, u) is None
    done = {
        "type": "response.completed",
        "response": {"usage": {"input_tokens": 2, "output_tokens": 8, "total_tokens": 10}},
    }
    assert apis.usage_of(apis.RESPONSES, done, None) == Usage(2, 8)
    created = {"type": "response.created", "response": {"usage": None}}
    assert apis.usage_of(apis.RESPONSES, created, None) is None


def test_first_token_of_typed_streams() -> None:
    assert classify_doc({"type": "response.created", "response": {}}) is Seen.PREAMBLE
    assert classify_doc({"type": "response.output_item.added"}) is Seen.PREAMBLE
    assert classify_doc({"type": "response.output_text.delta", "delta": "x"}) is Seen.CONTENT
    assert classify_doc({"type": "response.failed", "response": {}}) is Seen.ERROR
    assert classify_doc({"type": "error", "code": "x", "message": "m"}) is Seen.ERROR
    assert classify_doc({"type": "message_start", "message": {}}) is Seen.PREAMBLE
    assert classify_doc({"type": "ping"}) is Seen.PREAMBLE
    assert classify_doc({"type": "content_block_start"}) is Seen.PREAMBLE
    assert classify_doc({"type": "content_block_delta", "delta": {}}) is Seen.CONTENT
    assert classify_doc({"type": "error", "error": {"type": "overloaded_error"}}) is Seen.ERROR
    # vLLM's error object has a top-level `type` too: still an error
    assert classify_doc({"object": "error", "type": "BadRequestError"}) is Seen.ERROR
    assert apis.is_output({"type": "response.output_text.delta", "delta": "x"})
    assert apis.is_output({"type": "content_block_delta", "delta": {"text": "x"}})
    assert not apis.is_output({"type": "message_delta", "usage": {}})
    assert not apis.is_output({"type": "response.completed"})


def test_streamed_tokens_of_typed_events() -> None:
    assert chunk_tokens({"type": "response.output_text.delta", "delta": "abcdefgh"}) == 2
    assert chunk_tokens({"type": "content_block_delta", "delta": {"text": "a"}}) == 1
    assert chunk_tokens({"type": "content_block_delta", "delta": {"partial_json": "{}"}}) == 1
    assert chunk_tokens({"type": "message_delta", "usage": {"output_tokens": 3}}) == 0
    r = Reservation(10, 2)
    r.on_chunk({"type": "content_block_delta", "delta": {"text": "abcd"}})
    assert r.streamed == 1


def test_error_answers_in_dialect() -> None:
    status, body = apis.error_answer(apis.MESSAGES, 429, "rate_limited", "slow down")
    assert status == 429
    assert json.loads(body) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow down (rate_limited)"},
    }
    status, body = apis.error_answer(apis.MESSAGES, 503, "queue_full", "busy")
    assert status == 529
    assert json.loads(body)["error"]["type"] == "overloaded_error"
    for s, t in [
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (502, "api_error"),
        (504, "timeout_error"),
        (431, "invalid_request_error"),
    ]:
        assert (
            json.loads(apis.error_answer(apis.COUNT_TOKENS, s, "x", "m")[1])["error"]["type"] == t
        )
    status, body = apis.error_answer(apis.RESPONSES, 503, "queue_full", "busy")
    assert (status, json.loads(body)) == (503, {"error": {"type": "queue_full", "message": "busy"}})


def test_stream_errors_in_dialect() -> None:
    m = apis.stream_error(apis.MESSAGES, "upstream_reset", "cut")
    assert m is not None and m.startswith(b"event: error\ndata: ") and b"[DONE]" not in m
    doc = json.loads(m.split(b"data: ", 1)[1])
    assert doc["type"] == "error" and doc["error"]["type"] == "api_error"
    r = apis.stream_error(apis.RESPONSES, "upstream_reset", "cut")
    assert r is not None and b"[DONE]" not in r
    assert b"event: error\n" in r and b"event: response.failed\n" in r
    assert apis.stream_error(apis.CHAT, "x", "y") is None
    assert apis.stream_error(apis.COMPLETIONS, "x", "y") is None
