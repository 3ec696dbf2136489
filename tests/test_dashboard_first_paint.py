"""The dashboards draw at once from the snapshot inlined in their page, in a real browser
whose event stream is cut off (so nothing can come from it); the inlined snapshot is
escaped against whatever its strings hold."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest
from aiohttp import web

from omni.api import live
from omni.dashboard_page import PLACEHOLDER, PageAssets, data_block
from omni.testing.checkpoints import tiny_llama
from tests.browser import chromium
from tests.conftest import free_port, wait_until
from tests.nodes import Omnid

# what an instance's last output lines (a failure's reason) could hold
HOSTILE = "</script><script>document.title='pwned'</script><!--<script> & </SCRIPT >"


@pytest.fixture(scope="module")
def boards(tmp_path_factory):
    """omnid (dashboard on its own port) and an edge in front of it (dashboard too)."""
    tmp = tmp_path_factory.mktemp("first-paint")
    model = tiny_llama(tmp / "tiny")
    omnid_board, edge_board, edge_port = free_port(), free_port(), free_port()
    config = f'dashboard = "127.0.0.1:{omnid_board}"\n'
    config += f'[[models]]\nname = "tiny"\npath = "{model}"\npermits = 1\n'
    omnid = Omnid(tmp, config, "--sandbox", "process")
    argv = ["-m", "edge.server", "--port", str(edge_port), "--upstream", omnid.base_url]
    argv += ["--dashboard", f"127.0.0.1:{edge_board}"]
    edge = subprocess.Popen(
        [sys.executable, *argv], stdout=(tmp / "edge.log").open("w"), stderr=subprocess.STDOUT
    )
    try:
        omnid.wait_ready(["tiny"], 120)

        def edge_up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{edge_port}/healthz").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(edge_up, 60, "the edge routing to omnid", interval_s=0.2)
        yield {
            "omnid": omnid,
            "omnid_board": f"http://127.0.0.1:{omnid_board}",
            "edge_board": f"http://127.0.0.1:{edge_board}",
        }
    finally:
        edge.terminate()
        edge.wait(timeout=30)
        omnid.stop()


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


def without_stream(browser, url: str):
    """A page opened with its event stream refused: what it shows, it had from its page.
    Its uncaught errors are kept (the refused stream's console error is not one)."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.errors = []
    page.on("pageerror", lambda exc: page.errors.append(str(exc)))
    page.route("**/v1/dashboard/events", lambda route: route.abort())
    page.goto(url)
    return page


def cell(page, table: str, row: str, col: str):
    return page.locator(f'#{table} tr[data-name="{row}"] td[data-col="{col}"]')


def test_omnids_page_draws_its_instances_without_the_stream(boards, browser):
    from playwright.sync_api import expect

    body = {"model": "tiny", "prompt": "t1 t2", "max_tokens": 2}
    served = httpx.post(f"{boards['omnid'].base_url}/v1/completions", json=body, timeout=60)
    assert served.status_code == 200, served.text
    page = without_stream(browser, boards["omnid_board"] + "/dashboard")
    try:
        expect(cell(page, "instances", "tiny", "state")).to_have_text("ready", timeout=5000)
        expect(cell(page, "instances", "tiny", "residency")).to_have_text("cpu")
        expect(cell(page, "instances", "tiny", "last_used")).to_have_text(
            re.compile(r"^\d+ s ago$")
        )
        expect(page.locator("#node-meta")).to_contain_text("1 instance")
        expect(page.locator("#status")).not_to_contain_text("live")  # nothing streamed
        assert page.errors == []
    finally:
        page.close()


def test_the_edges_page_draws_its_nodes_without_the_stream(boards, browser):
    from playwright.sync_api import expect

    node = boards["omnid"].base_url
    page = without_stream(browser, boards["edge_board"] + "/dashboard")
    try:
        expect(cell(page, "nodes", node, "health")).to_have_text("up", timeout=5000)
        expect(cell(page, "nodes", node, "models")).to_have_text("tiny (1)")
        expect(page.locator("#status")).not_to_contain_text("live")
        assert page.errors == []
    finally:
        page.close()


def test_the_stream_takes_over_from_the_inlined_snapshot(boards, browser):
    from playwright.sync_api import expect

    page = browser.new_page()
    try:
        page.goto(boards["omnid_board"] + "/dashboard")
        expect(cell(page, "instances", "tiny", "state")).to_have_text("ready")
        expect(page.locator("#status")).to_contain_text("live", timeout=10_000)
    finally:
        page.close()


def test_the_inlined_snapshot_cannot_end_its_block():
    block = data_block({"s": HOSTILE})
    inner = block[len(PLACEHOLDER) - len(b"null</script>") : -len(b"</script>")]
    assert b"<" not in inner and b">" not in inner and b"&" not in inner
    assert data_block(None) == PLACEHOLDER


def test_hostile_strings_in_a_snapshot_stay_text_in_the_browser(boards, browser):
    """A failed instance's reason (its last output lines) holding markup: the page parses
    as it should and shows the string as it is."""
    from playwright.sync_api import expect

    with httpx.Client(transport=httpx.HTTPTransport(uds=str(boards["omnid"].socket))) as c:
        snap = c.get("http://omnid/v1/dashboard", timeout=10).json()
    snap["models"][0] |= {"state": "failed", "failure": HOSTILE}
    snapshots = live.Snapshots(lambda: {**snap, "at": time.time()}, "test")
    app = web.Application()
    live.add_routes(app, snapshots, PageAssets(snapshots, live.STATIC))
    with Served(app) as base:
        page = without_stream(browser, base + "/dashboard")
        try:
            state = cell(page, "instances", "tiny", "state")
            expect(state).to_have_text("failed", timeout=5000)
            expect(state).to_have_attribute("title", HOSTILE)
            assert page.title() == "omnid · dashboard"  # no script of the snapshot's ran
            scripts = page.eval_on_selector_all("script", "s => s.map(e => e.id || e.src)")
            assert scripts == ["snapshot", *(f"{base}/dashboard/{f}" for f in SCRIPTS)]
            assert page.errors == []
        finally:
            page.close()


SCRIPTS = ("uPlot.iife.min.js", "live.js", "node.js")


class Served:
    """`app` on a free loopback port, in a thread with its own loop: its base URL."""

    def __init__(self, app: web.Application):
        self.app, self.port = app, free_port()
        self.loop = asyncio.new_event_loop()
        self.up = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(self.app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        self.loop.run_until_complete(site.start())
        self.up.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())

    def __enter__(self) -> str:
        self.thread.start()
        assert self.up.wait(10)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
