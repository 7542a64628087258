"""The status page's charts (inline SVG drawn by status.js from `/admin/state`'s `series`) in a
real headless Chromium, in front of a real gateway with an admission queue and a simulated
backend with 8 generation slots, while two tenants stream through it. The page samples every
0.5 s here (SLUICE_STATUS_SAMPLE_S) so that a few seconds draw lines."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.admission_support import start, start_backend, two_tenants
from tests.integration.conftest import Backend, Gateway
from tests.status.browser import chromium

pytestmark = pytest.mark.integration


@pytest.fixture
def site(tmp_path: Path) -> Iterator[tuple[Backend, Gateway]]:
    be = start_backend(tmp_path / "be", slots=8, ttft_ms=20, token_ms=10)
    gw = start(be, tmp_path / "gw", max_in_flight=8, queue=True,
               env={"SLUICE_STATUS_SAMPLE_S": "0.5"})  # fmt: skip
    try:
        yield be, gw
    finally:
        gw.proc.stop()
        be.proc.stop()


def series(gw: Gateway) -> Any:
    with urllib.request.urlopen(f"{gw.admin}/admin/state", timeout=5) as r:
        return json.loads(r.read())["series"]


def test_charts_draw_the_last_minutes_of_traffic_queues_and_shares(
    site: tuple[Backend, Gateway], tmp_path: Path
) -> None:
    _, gw = site
    load = threading.Thread(target=lambda: asyncio.run(two_tenants(gw, 6.0, with_a=True)))
    load.start()
    try:
        with chromium() as browser:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.goto(f"{gw.admin}/status?refresh=1")
            page.wait_for_selector('figure[data-chart="share"] polyline[data-series="B"]',
                                   state="attached", timeout=20_000)  # fmt: skip
            load.join(30)
            page.wait_for_timeout(1500)  # one more refresh with the whole run in it
            charts = page.eval_on_selector_all(
                "figure[data-chart]",
                "fs => fs.map(f => [f.dataset.chart, [...f.querySelectorAll('polyline')]"
                ".map(p => [p.dataset.series, p.getAttribute('points').split(' ').length])])",
            )
            page.screenshot(path=str(tmp_path / "charts.png"), full_page=True)
            page.set_viewport_size({"width": 960, "height": 560})  # the README's picture
            page.screenshot(path=str(tmp_path / "readme-charts.png"))
            text = page.inner_text("#s-charts")
            section = page.inner_text("#s-admission")  # the owner's state, shown as tables
    finally:
        load.join(30)
    drawn: dict[str, dict[str, int]] = {}
    for name, lines in charts:
        for s, n in lines:
            drawn.setdefault(name, {})[s] = max(drawn.get(name, {}).get(s, 0), n)
    print(f"charts: {drawn}; screenshots in {tmp_path}")
    assert set(drawn) == {"rps", "p99", "ttft", "queue", "share"}, drawn
    for chart in ("rps", "p99", "ttft"):
        assert drawn[chart].get("sim", 0) >= 3, (chart, drawn)  # a line of several points
    assert drawn["queue"].get("sim", 0) >= 3
    assert {"A", "B"} <= set(drawn["share"])
    assert "COUNTER" in section.upper() and "SHARE" in section.upper() and "\tB\t" in section
    assert "requests per second" in text and "now" in text and "-60 s" in text  # a short run
    s = series(gw)
    assert s["step_s"] == 0.5 and len(s["t"]) == len(s["backends"]["sim"]["rps"])
    assert max(v for v in s["queues"]["sim"] if v is not None) > 0  # A's clients queued
    shares = [v for v in s["tenants"]["B"] if v]
    assert shares and all(0 < v <= 1 for v in shares)
