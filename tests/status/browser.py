"""Debian's Chromium, headless, driven by Playwright (never a browser Playwright downloads)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.support import require

CHROMIUM = Path("/usr/bin/chromium")
# No sandbox (root in CI), no GPU, and nothing that phones out: this machine's network is closed.
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A fresh browser (Playwright gives each launch a new, empty profile directory)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    require(sync_playwright is not None, "needs the playwright package (pip install -e .[dev])")
    require(CHROMIUM.exists(), "needs Debian's chromium (deploy/host-setup.sh installs it)")
    assert sync_playwright is not None
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            yield browser
        finally:
            browser.close()
