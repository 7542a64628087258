"""Model-server figures: the names, the line scanner, staleness, the score and the full rule."""

from __future__ import annotations

import pytest

from gateway.core.serverload import (
    PRESETS,
    Figures,
    Weights,
    fresh,
    full,
    parse_name,
    scan,
    score,
    slots,
    wanted,
)

VLLM = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 5.0
vllm:num_requests_running{engine="1",model_name="llama"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
vllm:num_requests_waiting{engine="0",model_name="llama"} 2.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 9.0
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.75
vllm:num_requests_running_total 99
vllm:e2e_request_latency_seconds_bucket{le="0.3",model_name="llama"} 4.0
"""

TRITON = b"""nv_trt_llm_request_metrics{model="ensemble",request_type="context",version="1"} 1
nv_trt_llm_request_metrics{model="ensemble",request_type="scheduled",version="1"} 6
nv_trt_llm_request_metrics{model="ensemble",request_type="waiting",version="1"} 2
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="ensemble"} 0.5
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="ensemble"} 100
"""


def test_vllm_page_sums_engines_and_takes_the_largest_kv_use() -> None:
    f = scan(VLLM, wanted("vllm", {}), now=7.0)
    assert (f.running, f.waiting, f.kv_cache, f.missing, f.at) == (8.0, 2.0, 0.75, (), 7.0)


def test_label_matchers_pick_one_series_of_a_family() -> None:
    f = scan(TRITON, wanted("triton", {}), now=0.0)
    assert (f.running, f.waiting, f.kv_cache) == (6.0, 2.0, 0.5)


def test_sglang_names_and_a_page_without_labels() -> None:
    page = b"sglang:num_running_reqs 3\nsglang:num_queue_reqs 0\nsglang:token_usage 0.1 17\n"
    f = scan(page, wanted("sglang", {}), now=0.0)
    assert (f.running, f.waiting, f.kv_cache) == (3.0, 0.0, 0.1)


def test_a_name_the_page_lacks_is_reported_not_read_as_zero() -> None:
    f = scan(VLLM, wanted("vllm", {"kv_cache": "vllm:gpu_cache_usage_perc"}), now=0.0)
    assert f.kv_cache is None and f.missing == ("vllm:gpu_cache_usage_perc",)
    assert f.running == 8.0


def test_names_override_the_preset() -> None:
    w = wanted("vllm", {"waiting": "my_queue{pool=a}", "running": None})
    assert [x.text for x in w] == [PRESETS["vllm"]["running"], "my_queue{pool=a}",
                                   PRESETS["vllm"]["kv_cache"]]  # fmt: skip
    assert w[1].name == b"my_queue" and w[1].labels == (b'pool="a"',)
    page = b'my_queue{pool="b"} 5\nmy_queue{pool="a"} 4\n'
    assert scan(page, w, 0.0).waiting == 4.0


@pytest.mark.parametrize("bad", ["", "a b", 'x{k="v"', "x{k}", 'x{"k"="v"}', "x{k=}"])
def test_malformed_names_are_errors(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_name("running", bad)


def test_malformed_value_lines_are_skipped() -> None:
    page = (
        b'vllm:num_requests_running{a="1"}\nvllm:num_requests_running x\n'
        b"vllm:num_requests_running NaN\nvllm:num_requests_running 2\n"
    )
    assert scan(page, wanted("vllm", {}), 0.0).running == 2.0


def test_staleness_is_three_intervals() -> None:
    f = Figures(1.0, 0.0, 0.0, (), at=10.0)
    assert fresh(f, 10.29, 0.1) and not fresh(f, 10.31, 0.1) and not fresh(None, 0.0, 0.1)


def test_score_counts_others_load_queue_then_kv() -> None:
    w = Weights()
    assert score(Figures(8.0, 0.0, 0.0, (), 0.0), 3, w) == 5.0  # 5 running we did not send
    assert score(Figures(2.0, 0.0, 0.0, (), 0.0), 3, w) == 0.0  # ours, counted already
    assert score(Figures(0.0, 3.0, 0.0, (), 0.0), 0, w) == 6.0  # each waiting counts 2
    assert score(Figures(0.0, 0.0, 1.5, (), 0.0), 0, w) == 4.0  # kv clamped to 1
    assert score(Figures(None, None, None, ("x",), 0.0), 0, w) == 0.0


def test_full_and_slots() -> None:
    assert full(Figures(0.0, 1.0, 0.0, (), 0.0), 8)  # anything waiting: full
    assert full(Figures(8.0, 0.0, 0.0, (), 0.0), 8)
    assert not full(Figures(7.0, 0.0, 0.0, (), 0.0), 8)
    assert not full(Figures(99.0, 0.0, 0.0, (), 0.0), None)  # no max_in_flight: only the queue
    assert slots(8, False, 3) == 8 and slots(8, True, 3) == 3 and slots(8, True, 20) == 8


def test_scan_reads_from_the_start_it_is_given() -> None:
    page = b"HTTP/1.1 200 OK\r\nvllm:num_requests_waiting 99\r\n\r\nvllm:num_requests_waiting 1\n"
    start = page.index(b"\r\n\r\n") + 4
    assert scan(page, wanted("vllm", {}), 0.0, start).waiting == 1.0  # not the header's 99
