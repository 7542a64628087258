"""gateway.jsonfast: the same values through orjson and through the standard-library fallback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gateway import jsonfast

DOC = {"model": "m", "messages": [{"role": "user", "content": "héllo"}], "max_tokens": 5}


def test_round_trip_and_compact_bytes() -> None:
    raw = jsonfast.dumps(DOC)
    assert isinstance(raw, bytes) and b" " not in raw.replace(b'"user"', b"")
    assert jsonfast.loads(raw) == DOC == jsonfast.loads(raw.decode())
    assert json.loads(raw) == DOC


def test_bad_json_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        jsonfast.loads(b'{"model": ')


def test_fallback_without_orjson() -> None:
    code = (
        "import sys; sys.modules['orjson'] = None\n"
        "from gateway import jsonfast\n"
        "assert jsonfast.BACKEND == 'json'\n"
        f"doc = {DOC!r}\n"
        "assert jsonfast.loads(jsonfast.dumps(doc)) == doc\n"
        "print(jsonfast.dumps(doc).decode())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == DOC
