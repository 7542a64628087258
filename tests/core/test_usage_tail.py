"""`usage_tail`: the usage of a whole JSON answer read from its tail. Wherever it finds one, it is
the answer's top-level `usage`: what parsing the whole answer gives (`usage_from`)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from gateway.core.body import Usage, usage_from, usage_tail


def loads(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def by_tail(raw: bytes) -> Usage | None:
    """What the forwarding path does (`gateway.forward.relay.on_json`): the tail, else the whole
    answer parsed."""
    u = usage_tail(raw, loads)
    return u if u is not None else usage_from(loads(raw))


USAGE = {"prompt_tokens": 12, "completion_tokens": 34, "total_tokens": 46}
DETAILS = {**USAGE, "prompt_tokens_details": {"cached_tokens": 3}}


VLLM_TAIL = ',"prompt_logprobs":null,"prompt_token_ids":null,"kv_transfer_params":null}'


@pytest.mark.parametrize(
    "raw",
    [
        json.dumps({"id": "c1", "choices": [{"message": {"content": "hi"}}], "usage": DETAILS}),
        json.dumps({"id": "c1", "choices": [], "usage": USAGE}, indent=2) + "\n",
        json.dumps({"id": "c1", "usage": DETAILS})[:-1] + VLLM_TAIL,
        '{"id": "x", "usage" : { "prompt_tokens" : 12, "completion_tokens" : 34, "n": "a}\\"b{"} }',
        # followed by an object: the one-parse guess (last member) fails, the count finds it
        json.dumps({"id": "c1", "usage": USAGE, "meta": {"a": {"b": 1}}}),
    ],
)
def test_the_usage_is_read_from_the_tail(raw: str) -> None:
    seen: list[bytes] = []

    def spy(b: bytes) -> Any:
        seen.append(b)
        return loads(b)

    assert usage_tail(raw.encode(), spy) == Usage(12, 34)
    assert seen and all(len(b) < len(raw.strip()) for b in seen)  # never the whole answer


def test_a_last_usage_is_one_parse_of_its_object() -> None:
    """The common case (OpenAI's order, the usage last): one parse, of the usage object alone."""
    seen: list[bytes] = []

    def spy(b: bytes) -> Any:
        seen.append(b)
        return loads(b)

    raw = json.dumps({"id": "c1", "choices": [{"message": {"content": "}"}}], "usage": DETAILS})
    assert usage_tail(raw.encode(), spy) == Usage(12, 34)
    assert seen == [json.dumps(DETAILS).encode()]


@pytest.mark.parametrize(
    "raw",
    [
        b'{"usage": {"prompt_tokens": 1, "completion_tokens": 2}, "id": {"a": 1}, "b": [}',
        b'{"a": {"usage": {"prompt_tokens": 1, "completion_tokens": 2}}}',  # nested
        b'{"a": {"usage": {"prompt_tokens": 1, "completion_tokens": 2}, "b": 1}}',  # nested
        b'{"a": "say \\"usage\\": {\\"prompt_tokens\\": 1}"}',  # inside a string
        b'{"a\\"usage": {"prompt_tokens": 1, "completion_tokens": 2}}',  # a key ending so
        b'{"a": ["usage"]}',
        b'{"usage": {"prompt_tokens": 1, "completion_tokens": 2}]',
        b"[1, 2]",
        b"",
        b"}",
    ],
)
def test_no_tail_usage_where_it_is_not_the_top_level_one(raw: bytes) -> None:
    assert usage_tail(raw, loads) is None


def test_only_the_end_of_a_long_answer_is_searched() -> None:
    usage = json.dumps({"usage": USAGE})[1:-1]
    near = '{"choices": ["' + "x" * 100_000 + '"], ' + usage + ', "b": "' + "y" * 5000 + '"}'
    assert usage_tail(near.encode(), loads) == Usage(12, 34)
    far = '{"choices": ["' + "x" * 100_000 + '"], ' + usage + ', "b": "' + "y" * 9000 + '"}'
    assert usage_tail(far.encode(), loads) is None  # then the whole answer is parsed
    assert by_tail(far.encode()) == Usage(12, 34)


def _value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(7 if depth < 3 else 3)
    if kind == 0:
        return rng.randrange(100)
    if kind == 1:
        return rng.choice(["usage", '"usage":{', "\\", 'x\\"usage\\"', "}", '{"a":1}'])
    if kind == 2:
        return None
    if kind in (3, 4):
        return {_key(rng): _value(rng, depth + 1) for _ in range(rng.randrange(4))}
    if kind == 5:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {"prompt_tokens": rng.randrange(9), "completion_tokens": rng.randrange(9)}


def _key(rng: random.Random) -> str:
    return rng.choice(["usage", "id", "choices", 'a"usage', "usage\\", "u"])


def test_the_tail_agrees_with_the_whole_answer_on_random_answers() -> None:
    rng = random.Random(7)
    tails = 0
    for _ in range(3000):
        doc = {_key(rng): _value(rng, 1) for _ in range(rng.randrange(4))}
        if rng.random() < 0.5:
            doc["usage"] = _value(rng, 2)
        raw = json.dumps(doc, indent=rng.choice([None, 1])).encode()
        expected = usage_from(json.loads(raw))
        assert by_tail(raw) == expected, raw
        if usage_tail(raw, loads) is not None:
            tails += 1
    assert tails > 150  # the fast path was taken, not only the fallback
