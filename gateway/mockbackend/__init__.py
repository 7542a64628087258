"""The simulated inference backend (`sluice mock-backend`): OpenAI-style HTTP with SSE (chat,
completions, embeddings, Responses) and Anthropic Messages, the Inference gRPC service, health,
vLLM-style gauges and an admin API to turn its knobs at run time.

    handle = await start_mock_backend("127.0.0.1:0", "127.0.0.1:0", Knobs(ttft_ms=5))
    ...
    await handle.close()
"""

from __future__ import annotations

from gateway.mockbackend.knobs import FAILURE_MODES, FailureMode, Knobs, MockState, Stats
from gateway.mockbackend.server import MockBackendHandle, start_mock_backend

__all__ = [
    "FAILURE_MODES",
    "FailureMode",
    "Knobs",
    "MockBackendHandle",
    "MockState",
    "Stats",
    "start_mock_backend",
]
