"""(compiled) Request id: keep a well-formed incoming X-Request-Id, else make one; forward it
upstream."""

from __future__ import annotations

import os
import random
import re
from typing import Any, Final

from gateway.context import RequestContext, Status
from gateway.services import Services

# Whole-string match: `$` would let a trailing newline through. The access log writes the id
# unescaped on the strength of this pattern.
_VALID: Final = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


# Request ids must be unique, not secret: a per-process PRNG seeded from the OS (at import, so
# every worker process differs) saves a getrandom() syscall per request.
_getrandbits: Final = random.Random(os.urandom(32)).getrandbits


def new_request_id() -> str:
    # (bytes.hex: a third of what formatting a 128-bit int with `:032x` costs; same text)
    return _getrandbits(128).to_bytes(16, "big").hex()


class RequestIdFilter:
    name = "request_id"

    def on_request(self, ctx: RequestContext) -> Status:
        incoming = ctx.info.headers.get("x-request-id")
        rid = incoming if incoming is not None and _VALID.fullmatch(incoming) else new_request_id()
        ctx.request_id = rid
        ctx.upstream_headers["x-request-id"] = rid
        return Status.CONTINUE


def build(section: Any, services: Services) -> RequestIdFilter:
    return RequestIdFilter()
