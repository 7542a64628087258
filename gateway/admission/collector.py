"""Admission queue state as Prometheus gauges, read at scrape time (nothing on the request path):
`sluice_admission_queue_length{pool,class}` (what an autoscaler such as KEDA scales on),
`sluice_admission_in_flight{pool}` and `sluice_admission_capacity{pool}`. Under `--workers N`
these are the answering worker's view."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.admission.owner import LIVE_BOOKS


class AdmissionCollector(Collector):
    def collect(self) -> Iterable[Metric]:
        length = GaugeMetricFamily(
            "sluice_admission_queue_length",
            "Requests waiting in a backend pool's admission queue, per priority class.",
            labels=["pool", "class"],
        )
        in_flight = GaugeMetricFamily(
            "sluice_admission_in_flight", "Requests holding a slot of the pool.", labels=["pool"]
        )
        capacity = GaugeMetricFamily(
            "sluice_admission_capacity", "Slots of the pool (its limit now).", labels=["pool"]
        )
        for book in list(LIVE_BOOKS):
            for name, p in list(book.pools.items()):
                q = p.q
                for c, cq in q.classes.items():
                    length.add_metric([name, str(c)], float(cq.waiting))
                in_flight.add_metric([name], float(q.busy))
                capacity.add_metric([name], float(q.capacity))
        return [length, in_flight, capacity]


COLLECTOR = AdmissionCollector()  # registered by the admin app (gateway.registry.collector)
