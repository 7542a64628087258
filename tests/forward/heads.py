"""What the header tests of the forwarding path share: a compiled policy, a request context on
it, and the spellings of a header name a peer may send."""

from __future__ import annotations

from collections.abc import Callable

from gateway.context import RequestContext
from gateway.core.request import RequestInfo, Wire
from gateway.policy.compiled import CompiledPolicy, compile_policy
from gateway.policy.model import Policy

POLICY: CompiledPolicy = compile_policy(
    Policy.model_validate(
        {
            "backends": [{"name": "b", "endpoints": [{"address": "127.0.0.1:1"}]}],
            "routes": [{"name": "r", "backend": "b"}],
        }
    )
)

# A name as sent: lower case (HTTP/2's), upper case, or capitalised words (most HTTP/1.1 peers).
SPELLINGS: list[Callable[[str], str]] = [str.lower, str.upper, str.title]


def request_context(peer: str = "10.0.0.1") -> RequestContext:
    return RequestContext(RequestInfo(Wire.HTTP, "POST", "/v1/x", {}, peer=peer), POLICY)
