"""CallAccounting: calls that end between grpc's handler lookup and Sluice's handler."""

from __future__ import annotations

import asyncio

from gateway.adapters.grpcio.calls import CallAccounting
from gateway.telemetry import metrics


def _count(reason: str) -> float:
    name = "sluice_grpc_calls_ended_before_handler_total"
    return metrics.REGISTRY.get_sample_value(name, {"reason": reason}) or 0.0


async def test_only_calls_that_never_reach_the_handler_are_counted() -> None:
    calls = CallAccounting()
    cancelled0, ended0 = _count("cancelled"), _count("no_request")

    async def handled() -> None:
        calls.looked_up()
        await asyncio.sleep(0)
        calls.started()

    async def no_request() -> None:  # grpc found no request message: returns quietly
        calls.looked_up()

    async def cancelled() -> None:  # the client went away while grpc waited for the message
        calls.looked_up()
        await asyncio.Event().wait()

    tasks = [asyncio.create_task(f()) for f in (handled, no_request, cancelled, handled)]
    await asyncio.sleep(0.01)
    assert calls.pending == 1  # the cancelled one, still waiting
    tasks[2].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(0)  # done callbacks run on the next loop turn
    assert (_count("cancelled") - cancelled0, _count("no_request") - ended0) == (1, 1)
    assert calls.pending == 0
