"""The edge's dashboard, in a real browser, in front of a real omnid (CPU engine, no GPU):
its tenants and nodes, live; and omnid's own page on a node without a GPU."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from edge.dashboard import parse
from edge.tenants import hash_key
from omni.testing.checkpoints import tiny_llama
from tests.browser import Page, chromium
from tests.conftest import free_port, wait_until
from tests.nodes import Omnid

KEYS = {"acme": "sk-acme-0123456789", "globex": "sk-globex-9876543210"}
WEIGHTS = {"acme": 3, "globex": 1}


def start_edge(tmp, upstream: str, *extra: str):
    """omni-edge on a free port: (process, its URL)."""
    port = free_port()
    log = (tmp / f"edge-{port}.log").open("w")
    argv = ["-m", "edge.server", "--port", str(port), "--upstream", upstream, *extra]
    proc = subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def up():
        if proc.poll() is not None:
            raise AssertionError((tmp / f"edge-{port}.log").read_text())
        try:
            return httpx.get(base + "/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(up, 60, "the edge healthy", interval_s=0.2)
    return proc, base


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("edge-dashboard")
    model = tiny_llama(tmp / "tiny")
    (tmp / "tenants.toml").write_text(
        "".join(
            f'[[tenants]]\nname = "{name}"\nweight = {WEIGHTS[name]}\nkeys = ["{hash_key(key)}"]\n'
            for name, key in KEYS.items()
        )
    )
    omnid_board = free_port()
    omnid = Omnid(
        tmp,
        f'dashboard = "127.0.0.1:{omnid_board}"\n'
        f'[[models]]\nname = "tiny"\npath = "{model}"\npermits = 1\n',
        "--sandbox",
        "process",
    )
    edge = None
    try:
        omnid.wait_ready(["tiny"], 120)
        board = free_port()
        edge, base = start_edge(
            tmp,
            omnid.base_url,
            "--tenants",
            str(tmp / "tenants.toml"),
            "--max-queued",
            "1",
            "--dashboard",
            f"127.0.0.1:{board}",
        )
        yield {
            "tmp": tmp,
            "omnid": omnid,
            "edge": base,
            "board": f"http://127.0.0.1:{board}",
            "omnid_board": f"http://127.0.0.1:{omnid_board}",
        }
    finally:
        if edge is not None:
            edge.terminate()
            edge.wait(timeout=30)
        omnid.stop()


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


def complete(base: str, tenant: str | None, max_tokens: int = 2) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/completions",
        json={"model": "tiny", "prompt": "t1 t2", "max_tokens": max_tokens},
        headers={"Authorization": f"Bearer {KEYS[tenant]}"} if tenant else {},
        timeout=60,
    )


def test_the_page_shows_the_nodes_and_the_tenants_live(cluster, browser):
    from playwright.sync_api import expect

    base = cluster["edge"]
    page = Page(browser, cluster["board"] + "/")
    p = page.page
    try:
        expect(p.locator("#status")).to_contain_text("live", timeout=10_000)
        node = cluster["omnid"].base_url
        expect(page.cell("nodes", node, "health")).to_have_text("up")
        expect(page.cell("nodes", node, "models")).to_have_text("tiny (1)")
        expect(page.cell("models", "tiny", "permits")).to_have_text("1")
        for name, weight in WEIGHTS.items():
            expect(page.cell("tenants", name, "weight")).to_have_text(str(weight))
            expect(page.cell("tenants", name, "requests")).to_have_text("0")

        for _ in range(3):
            assert complete(base, "acme").status_code == 200
        # globex floods: one runs, one waits (the queue holds one), the others are shed
        with ThreadPoolExecutor(5) as pool:
            replies = list(pool.map(lambda _: complete(base, "globex", 120), range(5)))
        statuses = [r.status_code for r in replies]
        shed = statuses.count(429)
        assert shed >= 1 and set(statuses) <= {200, 429}, statuses
        expect(page.cell("tenants", "acme", "requests")).to_have_text("3")
        expect(page.cell("tenants", "globex", "requests")).to_have_text("5")
        expect(page.cell("tenants", "globex", "shed")).to_have_text(str(shed))
        expect(page.cell("tenants", "globex", "shed")).to_have_attribute(
            "title", f"overloaded: {shed}"
        )
        expect(page.cell("tenants", "acme", "shed")).to_have_text("0")
        expect(page.cell("tenants", "globex", "share")).to_have_text(re.compile(r"^\d+\.\d%$"))
        for chart in ("tokens", "queued", "shed", "rtt", "inflight"):
            expect(p.locator(f"#chart-{chart} canvas")).to_have_count(1)
        assert page.errors == []
    finally:
        page.close()


def test_omnids_page_copes_with_a_node_without_a_gpu(cluster, browser):
    from playwright.sync_api import expect

    page = Page(browser, cluster["omnid_board"] + "/dashboard")
    try:
        expect(page.page.locator("#status")).to_contain_text("live", timeout=10_000)
        expect(page.page.locator("#no-gpu")).to_be_visible()
        expect(page.cell("instances", "tiny", "residency")).to_have_text("cpu")
        expect(page.cell("instances", "tiny", "state")).to_have_text("ready")
        expect(page.page.locator("#chart-requests canvas")).to_have_count(1)
        assert page.errors == []
    finally:
        page.close()


def test_the_dashboard_is_not_on_the_public_port_and_names_no_key(cluster):
    auth = {"Authorization": f"Bearer {KEYS['acme']}"}
    for path in ("/dashboard", "/dashboard/edge.js", "/v1/dashboard", "/v1/dashboard/events"):
        assert httpx.get(cluster["edge"] + path, headers=auth, timeout=10).status_code == 404
    board = cluster["board"]
    snap = httpx.get(board + "/v1/dashboard", timeout=10)
    assert snap.status_code == 200
    assert {t["name"] for t in snap.json()["tenants"]} == set(KEYS)
    assert [n["url"] for n in snap.json()["nodes"]] == [cluster["omnid"].base_url]
    for key in KEYS.values():
        assert key not in snap.text and hash_key(key) not in snap.text
    assert httpx.post(board + "/v1/dashboard", timeout=10).status_code == 405
    assert httpx.post(board + "/v1/completions", timeout=10).status_code == 404
    evil = httpx.get(board + "/v1/dashboard", headers={"Host": "evil.example"}, timeout=10)
    assert evil.status_code == 403


def test_a_dashboard_that_cannot_bind_never_stops_the_edge(cluster):
    taken = cluster["omnid_board"].rsplit(":", 1)[1]  # omnid's dashboard holds this port
    proc, base = start_edge(cluster["tmp"], cluster["omnid"].base_url, "--dashboard", taken)
    try:
        assert complete(base, None).status_code == 200  # serving (no tenants file: no keys)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    log = next(cluster["tmp"].glob(f"edge-{base.rsplit(':', 1)[1]}.log")).read_text()
    assert "cannot listen" in log


def test_dashboard_option_values():
    assert parse("off") is None
    assert parse("9180") == ("127.0.0.1", 9180)
    with pytest.raises(ValueError):
        parse("example.com:9180")
