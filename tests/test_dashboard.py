"""omnid's dashboard, in a real browser, on a real node whose "GPU" instances swap.

The node runs two instances on GPU 0 under the real shim over the fake CUDA (as
tests/cudashim/test_node_overcommit.py does: the CPU engine's memory is accounted and
moved by the shim as on a GPU) and one CPU instance. The page is opened through
`omnictl dashboard` (the admin socket, forwarded to a loopback port); the config's
`dashboard` key serves the same read-only routes on a TCP port of their own.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from aiohttp import web

from omni.api import live
from omni.testing.checkpoints import tiny_llama
from tests.browser import Page, chromium
from tests.conftest import free_port, wait_until
from tests.cudashim.conftest import fake  # noqa: F401  (the fake CUDA, built once)
from tests.nodes import Omnid

QUOTA = 48 << 20
BUDGET = 2 * QUOTA  # both GPU instances fit
GPU_MODELS = ("g1", "g2")
CPU_MODEL = "c1"
OMNICTL = (sys.executable, "-m", "omni.ctl")


class Node:
    def __init__(self, log_dir: Path, fake_cuda):
        self.root = Path(tempfile.mkdtemp(prefix="omni-dash-", dir="/tmp"))
        libdir = self.root / "cuda"
        shutil.copytree(
            fake_cuda.libdir, libdir, symlinks=True, ignore=shutil.ignore_patterns("shim")
        )
        base = tiny_llama(self.root / "models" / "base")
        self.dashboard_port = free_port()
        lines = [
            f'dashboard = "127.0.0.1:{self.dashboard_port}"\n',
            f'[[gpus]]\nindex = 0\nbudget = "{BUDGET}"\n',
        ]
        for name in GPU_MODELS:
            lines.append(f'[[models]]\nname = "{name}"\npath = "{base}"\ngpu = 0\nquota = {QUOTA}')
        lines.append(f'[[models]]\nname = "{CPU_MODEL}"\npath = "{base}"')
        self.omnid = Omnid(
            log_dir,
            "\n".join(lines),
            "--sandbox",
            "process",
            "--data-dir",
            str(self.root / "state"),
            env={
                "LD_LIBRARY_PATH": str(libdir),  # the fake CUDA, passed on to instances
                "OMNI_KV_CACHE_BYTES": str(2 << 20),
                "OMNI_TORCH_THREADS": "1",
            },
        )

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def complete(self, model: str) -> httpx.Response:
        return httpx.post(
            f"{self.omnid.base_url}/v1/completions",
            json={"model": model, "prompt": "t1 t2 t3", "max_tokens": 2, "temperature": 0},
            timeout=60,
        )

    def admin(self, method: str, path: str) -> httpx.Response:
        with self.omnid.admin() as client:
            return client.request(method, path)

    def stop(self) -> None:
        if self.omnid.proc.poll() is None:
            self.omnid.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def node(fake, tmp_path_factory):  # noqa: F811
    n = Node(tmp_path_factory.mktemp("dashboard"), fake)
    try:
        n.omnid.wait_ready([*GPU_MODELS, CPU_MODEL], 180)
        yield n
    finally:
        n.stop()


@pytest.fixture(scope="module")
def proxy(node):
    """`omnictl dashboard` on a free loopback port: the URL it prints."""
    port = free_port()
    proc = subprocess.Popen(
        [*OMNICTL, "--socket", str(node.omnid.socket), "dashboard", "--port", str(port)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()
        assert f"http://127.0.0.1:{port}/dashboard" in line, line + proc.stderr.read()
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


def test_the_page_shows_the_live_instances_and_follows_a_swap(node, proxy, browser):
    from playwright.sync_api import expect

    page = Page(browser, proxy + "/")  # `/` leads to /dashboard
    p = page.page
    try:
        expect(p.locator("#status")).to_contain_text("live", timeout=10_000)
        for name in (*GPU_MODELS, CPU_MODEL):
            expect(page.cell("instances", name, "state")).to_have_text("ready")
        expect(page.cell("instances", CPU_MODEL, "residency")).to_have_text("cpu")
        expect(page.cell("instances", "g1", "residency")).to_have_text("resident")
        gpu0 = p.locator('#gpu-bars .gpu[data-gpu="0"]')
        expect(gpu0.locator('.seg[data-name="g1"]')).to_be_visible()
        expect(gpu0.locator('.seg[data-name="g2"]')).to_be_visible()
        expect(p.locator("#no-gpu")).to_be_hidden()
        expect(p.locator("#node-sandbox")).to_contain_text("sandbox: process · enforced: none")
        expect(p.locator("#chart-gpu-0 canvas")).to_have_count(1)

        swap = node.admin("POST", "/v1/instances/g1/swap-out")
        assert swap.status_code == 200, swap.text
        expect(page.cell("instances", "g1", "residency")).to_have_text("swapped")
        expect(page.cell("instances", "g1", "swaps")).to_have_text("0/1")
        expect(gpu0.locator('.seg[data-name="g1"]')).to_have_count(0)
        expect(gpu0.locator(".swapped-list")).to_have_text("swapped out: g1")
        expect(gpu0.locator(".gpu-head")).to_contain_text("swaps in 0 / out 1")

        swap = node.admin("POST", "/v1/instances/g1/swap-in")
        assert swap.status_code == 200, swap.text
        expect(page.cell("instances", "g1", "residency")).to_have_text("resident")
        expect(page.cell("instances", "g1", "swaps")).to_have_text("1/1")
        expect(gpu0.locator('.seg[data-name="g1"]')).to_be_visible()

        for model in (CPU_MODEL, "g2", CPU_MODEL):
            assert node.complete(model).status_code == 200
        expect(page.cell("instances", CPU_MODEL, "requests")).to_have_text("2")
        expect(page.cell("instances", "g2", "requests")).to_have_text("1")
        expect(page.cell("instances", CPU_MODEL, "p50")).not_to_have_text("–")
        for chart in ("swaps", "requests", "latency", "queue"):
            expect(p.locator(f"#chart-{chart} canvas")).to_have_count(1)
        assert page.errors == []
    finally:
        page.close()


def test_the_snapshot_holds_what_the_node_records(node):
    snap = httpx.get(f"{node.dashboard_url}/v1/dashboard", timeout=10).json()
    (gpu,) = snap["gpus"]
    assert gpu["index"] == 0 and gpu["budget_bytes"] == BUDGET
    assert {p["name"] for p in gpu["resident"] + gpu["swapped"]} == set(GPU_MODELS)
    assert all(0 < p["used_bytes"] <= QUOTA for p in gpu["resident"])
    models = {m["name"]: m for m in snap["models"]}
    assert set(models) == {*GPU_MODELS, CPU_MODEL}
    assert models[CPU_MODEL]["residency"] is None and models[CPU_MODEL]["gpus"] == []
    assert models["g1"]["quota_bytes"] == QUOTA and models["g1"]["state"] == "ready"
    assert snap["swaps"]["out"] >= models["g1"]["swaps_out"]
    sandbox = snap["node"]["sandbox"]  # --sandbox process: no limit holds
    assert sandbox["mode"] == "process" and not any(sandbox["enforced"].values())


def test_the_routes_are_read_only_and_not_on_the_inference_port(node, proxy):
    for path in ("/dashboard", "/dashboard/live.js", "/v1/dashboard", "/v1/dashboard/events"):
        assert httpx.get(node.omnid.base_url + path, timeout=10).status_code == 404, path
    for base in (node.dashboard_url, proxy):
        page = httpx.get(base + "/dashboard", timeout=10)
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "default-src 'self'" in page.headers["content-security-policy"]
        lib = httpx.get(base + "/dashboard/uPlot.iife.min.js", timeout=10)
        assert lib.status_code == 200 and lib.text.startswith("/*! https://github.com/leeoniya")
        assert httpx.get(base + "/dashboard/uPlot.LICENSE", timeout=10).status_code == 404
        assert httpx.get(base + "/dashboard/..%2Fdashboard.py", timeout=10).status_code == 404
        assert httpx.post(base + "/v1/dashboard", timeout=10).status_code == 405
        # the admin API's actions are not there, whatever the method
        assert httpx.get(base + "/v1/instances", timeout=10).status_code == 404
        assert httpx.post(base + "/v1/instances/g1/swap-out", timeout=10).status_code == 404
        assert httpx.delete(base + "/v1/models/g1", timeout=10).status_code == 404
        # a name rebound to 127.0.0.1 by a page elsewhere does not reach it
        evil = httpx.get(base + "/v1/dashboard", headers={"Host": "evil.example"}, timeout=10)
        assert evil.status_code == 403
    assert node.admin("GET", "/v1/instances").json()["instances"][0]["state"] == "ready"


def test_the_event_stream_sends_a_snapshot_every_second(node):
    stamps = []
    transport = httpx.HTTPTransport(uds=str(node.omnid.socket))
    with (
        httpx.Client(transport=transport, base_url="http://omnid", timeout=10) as client,
        client.stream("GET", "/v1/dashboard/events") as resp,
    ):
        assert resp.headers["content-type"] == "text/event-stream"
        for line in resp.iter_lines():
            if line.startswith("data: "):
                stamps.append(json.loads(line[6:])["at"])
            if len(stamps) == 3:
                break
    assert 1.5 < stamps[-1] - stamps[0] < 4, stamps


def streams_open(node) -> int:
    """omnid's connections on its dashboard port."""
    conns = psutil.Process(node.omnid.proc.pid).net_connections("tcp")
    return sum(1 for c in conns if c.laddr.port == node.dashboard_port and c.raddr)


def test_a_stream_ends_when_its_client_goes(node):
    with httpx.stream("GET", f"{node.dashboard_url}/v1/dashboard/events", timeout=10) as resp:
        lines = resp.iter_lines()  # held: a generator let go closes the connection
        assert next(line for line in lines if line.startswith("data: "))
        assert streams_open(node) == 1
    wait_until(lambda: streams_open(node) == 0, 5, "omnid to close the stream")


def test_omnid_stops_at_once_with_streams_open(node):
    """Last of the node's tests: it stops omnid."""
    ends = []

    def watch() -> None:
        with httpx.stream("GET", f"{node.dashboard_url}/v1/dashboard/events", timeout=30) as r:
            ends.extend(line for line in r.iter_lines() if line.startswith("event: "))

    with ThreadPoolExecutor(1) as thread:
        watching = thread.submit(watch)
        wait_until(lambda: streams_open(node) == 1, 5, "the stream open")
        t0 = time.monotonic()
        assert node.omnid.stop() == 0
        stopped_s = time.monotonic() - t0
        watching.result(timeout=10)
    assert ends == ["event: end"]
    assert stopped_s < 10, stopped_s  # not aiohttp's 60 s wait for open handlers


def test_a_failing_snapshot_is_logged_and_the_stream_goes_on(caplog):
    """The builder raises once: the stream says so and goes on with the next one."""
    calls = []

    def build() -> dict:
        calls.append(time.monotonic())
        if len(calls) == 2:
            raise RuntimeError("boom")
        return {"n": len(calls)}

    async def run() -> list[str]:
        app = web.Application()
        live.add_routes(app, live.Snapshots(build, "test"), live.Assets(live.STATIC))
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        events: list[str] = []
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                url = f"http://127.0.0.1:{port}/v1/dashboard/events"
                async with client.stream("GET", url) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith(('data: {"n"', "event: ")):
                            events.append(line)
                        if len(events) == 3:
                            break
        finally:
            await runner.cleanup()  # ends open streams: cleanup does not wait for them
        return events

    with ThreadPoolExecutor(1) as thread:  # its own loop: Playwright's runs in this thread
        events = thread.submit(asyncio.run, asyncio.wait_for(run(), 20)).result()
    assert events == ['data: {"n":1}', "event: failed", 'data: {"n":3}']
    assert "test dashboard: snapshot failed" in caplog.text and "boom" in caplog.text


def test_binds_are_loopback_unless_an_address_is_written_out():
    assert live.parse_bind("9181", "x") == ("127.0.0.1", 9181)
    assert live.parse_bind("localhost:9181", "x") == ("127.0.0.1", 9181)
    assert live.parse_bind("[::1]:9181", "x") == ("::1", 9181)
    assert live.parse_bind("0.0.0.0:9181", "x") == ("0.0.0.0", 9181)  # written out: taken
    for value in (":9181", "dashboard.example:9181", "127.0.0.1", "127.0.0.1:0", True):
        with pytest.raises(ValueError):
            live.parse_bind(value, "x")


def test_quantiles_over_a_window_of_histograms():
    inf = float("inf")
    window = live.HistogramWindow(window_s=10)
    window.update(0.0, {"m": {0.1: 10, 1.0: 10, inf: 10}})
    assert window.summary("m")["p50_s"] == pytest.approx(0.05)  # since start
    window.update(5.0, {"m": {0.1: 10, 1.0: 20, inf: 20}})  # 10 more, all in (0.1, 1]
    assert window.summary("m") == {"p50_s": pytest.approx(0.55), "p99_s": pytest.approx(0.991),
                                   "count": 10, "window_s": 5.0}  # fmt: skip
    window.update(20.0, {"m": {0.1: 10, 1.0: 20, inf: 20}})
    assert window.summary("m")["p50_s"] is None  # nothing in the last 10 s


def test_the_config_key_names_a_listener_loopback_unless_written_out(tmp_path):
    from omni.runtime.catalog import CatalogError, load_config

    path = tmp_path / "omnid.toml"
    for value, bind in (("9181", ("127.0.0.1", 9181)), ('"10.0.0.5:9181"', ("10.0.0.5", 9181))):
        path.write_text(f"dashboard = {value}\n")
        assert load_config(path).dashboard == bind
    path.write_text("")
    assert load_config(path).dashboard is None
    path.write_text('dashboard = "omni.example:9181"\n')
    with pytest.raises(CatalogError, match=r"'dashboard': 'omni\.example' is not an IP address"):
        load_config(path)
