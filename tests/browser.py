"""Debian's chromium driven by Playwright (no browser download): for the console's browser test and
the console benchmarks. `scripts/system_packages.sh` installs chromium where it is missing; when it is still
missing the caller fails loudly (a console test that skips would pass CI without a browser)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = os.environ.get("ATDP_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]


class BrowserMissing(RuntimeError):
    pass


@contextmanager
def chromium() -> Iterator:
    """A Playwright `Browser` on the system chromium."""
    if not Path(CHROMIUM).exists():
        raise BrowserMissing(f"{CHROMIUM} not found: run scripts/system_packages.sh (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()
