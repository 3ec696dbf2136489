"""An instance runs exactly the code omnid runs, however omnid was started; an instance
that cannot start fails fast, with its reason, instead of restarting forever."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from omni.testing.checkpoints import tiny_llama
from tests.conftest import wait_until
from tests.nodes import Omnid

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxed instances need root")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("models") / "tiny")


def config(model: Path) -> str:
    return f'[[models]]\nname = "m"\npath = "{model}"\n'


def answers(node: Omnid, package: Path) -> None:
    """The sandboxed instance comes up and completes, and omnid said at start which
    interpreter and `omni` package its instances run."""
    try:
        node.models()
        node.wait_ready(["m"], timeout_s=120)
        body = {"model": "m", "prompt": "t1 t2", "max_tokens": 3}
        r = httpx.post(f"{node.base_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert f"with omni from {package}" in node.log_path.read_text()
    finally:
        assert node.stop() == 0, node.log()


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="not run from a virtual environment")
def test_omnid_from_a_venv_reached_through_a_symlink(tmp_path, model_dir):
    link = tmp_path / "venv-link"
    link.symlink_to(Path(sys.prefix).resolve())
    python = link / "bin" / Path(sys.executable).name
    node = Omnid(tmp_path, config(model_dir), python=str(python), cwd=tmp_path)
    answers(node, REPO / "omni")


def test_omnid_with_dash_m_from_another_source_tree(tmp_path, model_dir):
    """omnid imports `omni` from its working directory; the installed finder would give
    an instance the checkout this test runs from."""
    tree = tmp_path / "other-checkout"
    shutil.copytree(REPO / "omni", tree / "omni", ignore=shutil.ignore_patterns("__pycache__"))
    node = Omnid(tmp_path, config(model_dir), cwd=tree)
    answers(node, tree / "omni")


def test_omnid_from_an_installed_package(tmp_path, model_dir):
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*pip, "--target", str(site), str(REPO)],
        check=True,
        timeout=300,
    )
    shutil.rmtree(REPO / "build", ignore_errors=True)  # setuptools' leftovers
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    node = Omnid(tmp_path, config(model_dir), cwd=Path("/"), env={"PYTHONPATH": path})
    answers(node, site / "omni")


def test_an_instance_that_cannot_start_fails_fast_with_its_reason(tmp_path, model_dir):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a truncated download, say
    node = Omnid(tmp_path, config(broken))
    try:
        node.models()
        failed = wait_until(
            lambda: node.instances()["m"].get("failure"), 120, "the instance marked failed"
        )
        inst = node.instances()["m"]
        assert inst["state"] == "failed"
        restarts = inst["restarts"]
        assert failed.startswith("exited (code 1) on 3 starts in a row; last output:")
        assert "safetensors" in failed.lower() or "header" in failed.lower(), failed

        t0 = time.monotonic()
        r = httpx.post(
            f"{node.base_url}/v1/completions", json={"model": "m", "prompt": "t1"}, timeout=30
        )
        assert time.monotonic() - t0 < 20  # at once, not after request_timeout (60 s)
        assert r.status_code == 503 and "Retry-After" in r.headers
        assert r.json()["error"]["message"] == f"Model 'm' failed to start: {failed}"

        listed = httpx.get(f"{node.base_url}/v1/models", timeout=10).json()["data"]
        assert [(m["id"], m["state"], m["error"]) for m in listed] == [("m", "failed", failed)]
        shown = subprocess.run(
            [sys.executable, "-m", "omni.ctl", "--socket", str(node.socket), "instances"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert f"m failed: {failed[:40]}" in shown
        time.sleep(2)
        assert node.instances()["m"]["restarts"] == restarts  # no longer restarted
    finally:
        assert node.stop() == 0


def test_overcommit_bench_stops_at_a_failed_instance(tmp_path, model_dir):
    """The bench's wait for its instances ends with their error, not at its 900 s limit."""
    import asyncio

    from bench.overcommit_bench import Omnid as BenchOmnid

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not weights")
    node = BenchOmnid(config(broken), tmp_path, "isolated")
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="instances failed to start:\nm: exited"):
            asyncio.run(node.wait_ready(["m"], timeout_s=900))
    finally:
        node.stop()
    assert time.monotonic() - t0 < 120


def test_engine_bench_stops_at_a_worker_that_cannot_start(tmp_path, model_dir):
    import asyncio

    from bench.engine_bench import Worker

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not weights")
    worker = Worker(broken, tmp_path)
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="worker exited") as failed:
            asyncio.run(worker.wait_ready(900))
    finally:
        worker.stop()
    assert time.monotonic() - t0 < 120
    assert "Traceback" in str(failed.value)  # the worker's own error, in the message
