"""Tail sampler: the decision table, the exact ratio threshold, the pending buffer's bounds."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from gateway.core.outcome import Outcome
from gateway.core.pending import PendingTraces
from gateway.core.sampler import ONE, Reason, TailSampler, threshold
from gateway.core.traceparent import MASK64, client_span_id, parse, render

S = TailSampler(ratio=1e-5, slow_s=2.0, error_status=400)
LOW = 5  # a trace id whose low 64 bits are under 1e-5 · 2^64
HIGH = MASK64  # never under the ratio


@pytest.mark.parametrize(
    ("outcome", "rejected", "http", "grpc", "duration", "linked", "trace", "reason"),
    [
        (Outcome.OK, False, 200, None, 0.01, False, HIGH, Reason.NOT_SAMPLED),
        (Outcome.OK, False, 200, None, 0.01, False, LOW, Reason.RATIO),
        (Outcome.OK, False, 399, None, 0.01, False, HIGH, Reason.NOT_SAMPLED),
        (Outcome.OK, False, 400, None, 0.01, False, HIGH, Reason.ERROR),
        (Outcome.OK, False, 503, None, 0.01, False, HIGH, Reason.ERROR),
        (Outcome.OK, False, 0, 0, 0.01, False, HIGH, Reason.NOT_SAMPLED),
        (Outcome.OK, False, 0, 14, 0.01, False, HIGH, Reason.ERROR),
        (Outcome.REJECTED, True, 429, None, 0.0, False, HIGH, Reason.REJECTED),
        (Outcome.OK, True, 0, 8, 0.0, False, HIGH, Reason.REJECTED),  # gRPC shed
        (Outcome.UPSTREAM_TIMEOUT, False, 504, None, 5.0, False, HIGH, Reason.TIMEOUT),
        (Outcome.DEADLINE, False, 0, 4, 1.0, False, HIGH, Reason.TIMEOUT),
        (Outcome.INTERNAL, False, 500, None, 0.0, False, HIGH, Reason.ERROR),
        (Outcome.CLIENT_CANCELLED, False, 0, 1, 0.1, False, HIGH, Reason.ERROR),
        (Outcome.UPSTREAM_CONNECT, False, 502, None, 0.0, False, HIGH, Reason.ERROR),
        (Outcome.OK, False, 200, None, 2.5, False, HIGH, Reason.SLOW),
        (Outcome.OK, False, 200, None, 2.0, False, HIGH, Reason.NOT_SAMPLED),  # not slower
        (Outcome.OK, False, 200, None, 0.01, True, HIGH, Reason.LINKED),
    ],
)
def test_decision_table(
    outcome: Outcome,
    rejected: bool,
    http: int,
    grpc: int | None,
    duration: float,
    linked: bool,
    trace: int,
    reason: Reason,
) -> None:
    d = S.decide(trace, outcome, rejected, http, grpc, duration, linked)
    assert d.reason is reason
    assert d.keep is (reason is not Reason.NOT_SAMPLED)


def test_error_status_is_configurable() -> None:
    s = TailSampler(ratio=0.0, slow_s=2.0, error_status=500)
    assert not s.decide(HIGH, Outcome.OK, False, 404, None, 0.0).keep
    assert s.decide(HIGH, Outcome.OK, False, 500, None, 0.0).keep
    assert s.decide(HIGH, Outcome.REJECTED, True, 429, None, 0.0).keep  # refusals stay kept


def test_threshold_is_exact_at_the_written_decimal() -> None:
    assert threshold(1e-5) == ONE // 100_000
    assert threshold(0.001) == ONE // 1000
    assert threshold(1.0) == ONE
    assert threshold(0.0) == 0
    assert S.threshold == ONE // 100_000


def test_ratio_uses_the_low_64_bits_only() -> None:
    t = ONE // 100_000
    assert S.sampled(t - 1)
    assert not S.sampled(t)
    assert S.sampled((0xDEADBEEF << 64) | (t - 1))  # high bits do not matter
    assert not S.sampled((0xDEADBEEF << 64) | t)


def test_ratio_keep_carries_the_adjusted_count() -> None:
    d = S.decide(LOW, Outcome.OK, False, 200, None, 0.01)
    assert d.reason is Reason.RATIO and d.adjusted_count == pytest.approx(100_000)
    assert S.decide(HIGH, Outcome.OK, False, 500, None, 0.01).adjusted_count == 1.0


def test_same_decision_in_every_replica() -> None:
    rng = random.Random(7)
    ids = [rng.getrandbits(128) for _ in range(2000)]
    a = TailSampler(0.1, 2.0)
    b = TailSampler(0.1, 2.0)
    assert [a.sampled(i) for i in ids] == [b.sampled(i) for i in ids]


@pytest.mark.parametrize(("ratio", "n"), [(1e-5, 4_000_000), (0.05, 40_000)])
def test_kept_count_fits_the_binomial(ratio: float, n: int) -> None:
    """Over random trace ids, the kept count stays within 5 sigma of n·ratio."""
    s = TailSampler(ratio, 2.0)
    rng = random.Random(2024)
    bits = rng.getrandbits
    kept = sum(1 for _ in range(n) if s.sampled(bits(128)))
    mean = n * ratio
    sigma = (n * ratio * (1 - ratio)) ** 0.5
    assert abs(kept - mean) <= 5 * sigma, (kept, mean, sigma)


# --- W3C traceparent --------------------------------------------------------------------------

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (TP, (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1)),
        (f" {TP} ", (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1)),
        (TP[:-2] + "00", (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 0)),
        ("01" + TP[2:] + "-future", (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1)),
        (TP + "-x", None),  # version 00 is exactly 55 characters
        ("ff" + TP[2:], None),
        (TP.upper(), None),
        ("00-" + "0" * 32 + "-00f067aa0ba902b7-01", None),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01", None),
        ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", None),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g", None),
        ("", None),
        ("garbage" * 10, None),
    ],
)
def test_parse_traceparent(value: str, expected: tuple[int, int, int] | None) -> None:
    assert parse(value) == expected


def test_render_round_trips() -> None:
    assert render(*parse(TP)) == TP  # type: ignore[misc]


def test_client_span_ids_differ_per_try_and_from_the_server_span() -> None:
    for s in (1, 0x00F067AA0BA902B7, MASK64 - 1, MASK64):
        ids = {s, *(client_span_id(s, n) for n in range(8))}
        assert len(ids) == 9 and 0 not in ids and max(ids) <= MASK64


# --- the pending buffer -----------------------------------------------------------------------


def test_pending_merges_a_trace_and_caps_its_spans() -> None:
    p: PendingTraces[str] = PendingTraces(max_traces=10, max_spans=5, max_wait=1.0)
    assert p.offer(1, "a", 2, now=0.0)
    assert p.offer(1, "b", 3, now=0.1)
    assert not p.offer(1, "c", 1, now=0.2)  # would be the 6th span
    assert p.dropped_spans == 1 and p.spans == 5 and len(p) == 1
    assert 1 in p and 2 not in p
    assert p.due(now=0.99) == []
    assert p.due(now=1.0) == [(1, ["a", "b"])]
    assert len(p) == 0 and p.spans == 0


def test_pending_drops_the_oldest_when_full() -> None:
    p: PendingTraces[int] = PendingTraces(max_traces=3, max_spans=10, max_wait=1.0)
    for t in range(5):
        p.offer(t, t, 1, now=float(t))
    assert [t for t, _ in p.drain()] == [2, 3, 4]
    assert p.dropped_traces == 2


def test_pending_due_is_oldest_first_and_stops_at_the_first_young() -> None:
    p: PendingTraces[int] = PendingTraces(max_traces=10, max_spans=10, max_wait=1.0)
    p.offer(1, 1, 1, now=0.0)
    p.offer(2, 2, 1, now=0.5)
    p.offer(1, 11, 1, now=0.9)  # joins trace 1: does not make it younger
    assert p.due(now=1.2) == [(1, [1, 11])]
    assert p.due(now=1.5) == [(2, [2])]


def test_pending_resize_drops_the_oldest_beyond_the_new_bound() -> None:
    p: PendingTraces[int] = PendingTraces(max_traces=10, max_spans=10, max_wait=1.0)
    for t in range(6):
        p.offer(t, t, 2, now=0.0)
    p.resize(max_traces=2, max_spans=4, max_wait=0.5)
    assert len(p) == 2 and p.spans == 4 and p.dropped_traces == 4
    assert [t for t, _ in p.drain()] == [4, 5]


def test_a_million_traces_stay_within_the_bound() -> None:
    """Memory is bounded by max_traces, not by what is offered."""
    p: PendingTraces[tuple[int, int]] = PendingTraces(max_traces=1000, max_spans=8, max_wait=60.0)
    tracemalloc.start()
    try:
        for t in range(1_000_000):
            p.offer(t, (t, t), 2, now=t * 1e-6)
            if t == 10_000:
                tracemalloc.reset_peak()
                at_ten_thousand = tracemalloc.get_traced_memory()[0]
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(p) == 1000 and p.spans == 2000
    assert p.dropped_traces == 999_000
    # No growth after the buffer filled (dict tables fluctuate a little as entries turn over).
    assert peak < 2 * at_ten_thousand, (peak, at_ten_thousand)
    assert current < 2 * 1024 * 1024
