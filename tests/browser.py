"""A real headless browser for the dashboards' tests: Playwright driving Debian's Chromium
(`make setup` installs it), never a browser downloaded at test time."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")


@contextlib.contextmanager
def chromium() -> Iterator:
    """A headless Chromium; the test skips, saying why, where there is none."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: `make setup` installs Debian's chromium")
    sync_api = pytest.importorskip("playwright.sync_api", reason="`make setup` installs playwright")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            yield browser
        finally:
            browser.close()


class Page:
    """A page whose console errors and uncaught exceptions are kept, to assert none."""

    def __init__(self, browser, url: str):
        self.errors: list[str] = []
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        self.page.goto(url)

    def _console(self, message) -> None:
        if message.type == "error":
            self.errors.append(f"console: {message.text} ({message.location.get('url')})")

    def cell(self, table: str, row: str, col: str):
        """The `col` cell of the row named `row` in the table with id `table`."""
        return self.page.locator(f'#{table} tr[data-name="{row}"] td[data-col="{col}"]')

    def close(self) -> None:
        self.page.close()
