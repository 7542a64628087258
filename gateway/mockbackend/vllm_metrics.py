"""The simulated backend's `/metrics`: vLLM's names, telling the truth about its own slots.

- `vllm:num_requests_running`: completions holding a generation slot now (`--slots N`: at most
  N; without slots, every completion being generated);
- `vllm:num_requests_waiting`: completions waiting for a slot, plus the `waiting` knob (load
  a test pretends to have);
- `vllm:kv_cache_usage_perc`: running ÷ slots (0 without slots), or the `load` knob if higher;
- `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total`: prompt tokens looked up
  in the prefix cache and found there (as vLLM counts them).

Computed at scrape time, in a registry of its own (never the gateway's).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.mockbackend.knobs import MockState


def figures(state: MockState) -> tuple[int, int, float]:
    """(running, waiting, KV-cache use 0-1) as the backend reports them."""
    knobs = state.knobs
    running = state.stats.generating
    queued = sum(1 for f in state.slots.waiters if not f.done())
    kv = min(1.0, running / knobs.slots) if knobs.slots else 0.0
    return running, queued + knobs.waiting, max(kv, knobs.load)


class VllmGauges(Collector):
    """What a load-aware balancer reads from vLLM, computed at scrape time."""

    def __init__(self, state: MockState, model: str) -> None:
        self._state = state
        self._model = [model]

    def collect(self) -> Iterable[Metric]:
        state, model = self._state, self._model
        running_n, waiting_n, kv_use = figures(state)
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Requests in a generation slot.", labels=["model_name"]
        )
        running.add_metric(model, running_n)
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting",
            "Requests waiting for a slot (plus the `waiting` knob).",
            labels=["model_name"],
        )
        waiting.add_metric(model, waiting_n)
        kv = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "KV-cache use, 0..1: slots in use (or the `load` knob, if higher).",
            labels=["model_name"],
        )
        kv.add_metric(model, kv_use)
        cs = state.cache.stats
        queries = CounterMetricFamily(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            labels=["model_name"],
        )  # fmt: skip
        queries.add_metric(model, cs.hit_tokens + cs.miss_tokens)
        hits = CounterMetricFamily(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
            labels=["model_name"],
        )  # fmt: skip
        hits.add_metric(model, cs.hit_tokens)
        return [running, waiting, kv, queries, hits]
