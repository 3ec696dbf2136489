"""`omni serve` stops everything it started, however it is stopped."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import psutil

from .conftest import start_server

DEFAULTS = ["smollm2-135m-instruct", "all-minilm-l6-v2"]


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def test_ctrl_c_stops_everything_within_seconds(tmp_path):
    server = start_server(tmp_path)
    instances = server.wait_ready(DEFAULTS)
    family = descendants(server.proc.pid)
    assert {i["pid"] for i in instances.values()} <= {p.pid for p in family}
    assert len(family) == 4  # omnid, edge, two instances
    elapsed = server.stop(signal.SIGINT)
    assert elapsed < 5
    assert server.proc.returncode == 0
    assert not server.admin_socket.exists()
    assert not list((server.runtime_dir / "instances").glob("*.sock"))


def test_killed_serve_leaves_no_process_behind(tmp_path):
    server = start_server(tmp_path)
    server.wait_ready(DEFAULTS)
    family = descendants(server.proc.pid)
    server.proc.kill()
    server.proc.wait(5)
    _gone, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, [p.cmdline() for p in alive]
    try:
        httpx.get(f"{server.base_url}/healthz", timeout=1)
        raise AssertionError("edge still answering")
    except httpx.TransportError:
        pass


def test_config_adds_models_and_can_drop_defaults(tmp_path, text_model_dir):
    config = tmp_path / "omnid.toml"
    config.write_text(f'default_models = false\n[[models]]\nname = "mine"\n'
                      f'path = "{text_model_dir}"\n')
    server = start_server(tmp_path, "--config", str(config))
    try:
        server.wait_ready(["mine"])
        models = httpx.get(f"{server.base_url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["mine"]
    finally:
        server.stop()


def test_invalid_config_refuses_to_start(tmp_path):
    config = tmp_path / "omnid.toml"
    config.write_text('[[models]]\nname = "x"\npath = "/nonexistent"\n')
    result = subprocess.run(
        [sys.executable, "-m", "omni.runtime.omnid", "--config", str(config), "--no-defaults",
         "--runtime-dir", str(tmp_path / "run"), "--port", "0"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "/nonexistent: not a directory" in result.stderr
