"""(compiled) How a request ended, as one closed set: what metrics, the access log, breakers and the
tail sampler read instead of a free-form error string."""

from __future__ import annotations

import enum
from typing import Final


class Outcome(enum.Enum):
    """The value is the label used in logs and metrics."""

    OK = "ok"  # answered as the backend answered (whatever its status; see `upstream_failed`)
    REJECTED = "rejected"  # refused by Sluice: ctx.verdict says why (auth, limit, no route, ...)
    BAD_REQUEST = "bad_request"  # the client's request was malformed or its body incomplete
    CLIENT_CANCELLED = "client_cancelled"  # the client went away (or cancelled the call)
    DEADLINE = "deadline"  # the client's own deadline expired (gRPC)
    UPSTREAM_CONNECT = "upstream_connect_error"  # no connection to the backend could be had
    UPSTREAM_TLS = "upstream_tls_error"  # the TLS handshake failed (certificate, name, mTLS)
    UPSTREAM_TIMEOUT = "upstream_timeout"  # connect / first byte / idle / total deadline
    UPSTREAM_PROTOCOL = "upstream_protocol_error"  # broken HTTP, invalid head, or reset mid-answer
    UPSTREAM_ERROR = "upstream_error"  # the backend answered 5xx / a gRPC failure status
    STREAM_CUT = "stream_cut"  # a filter ended the response early (e.g. token overrun)
    STALLED = "client_stalled"  # the client stopped reading for longer than idle_s
    INTERNAL = "internal"  # a bug of Sluice's own

    @property
    def upstream_failed(self) -> bool:
        """A failure the backend is to blame for (what breakers and outlier ejection count)."""
        return self in _UPSTREAM


_UPSTREAM: Final = frozenset(
    {
        Outcome.UPSTREAM_CONNECT,
        Outcome.UPSTREAM_TLS,
        Outcome.UPSTREAM_TIMEOUT,
        Outcome.UPSTREAM_PROTOCOL,
        Outcome.UPSTREAM_ERROR,
    }
)
