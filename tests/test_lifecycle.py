"""`omni serve` stops everything it started, however it is stopped."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import psutil
import pytest

from omni import supervise

from .conftest import DEFAULT_MODELS, running_server


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def test_ctrl_c_stops_everything_within_seconds(tmp_path):
    with running_server(tmp_path, ready=DEFAULT_MODELS) as server:
        instances = server.instances()
        family = descendants(server.proc.pid)
        assert {i["pid"] for i in instances.values()} <= {p.pid for p in family}
        # it ends, after its own SIGKILL at worst, and no descendant survives
        elapsed = server.stop(signal.SIGINT, timeout_s=supervise.STOP_GRACE_S + 10)
    print(f"stopped in {elapsed:.2f} s")
    assert server.proc.returncode == 0
    assert not server.admin_socket.exists()
    assert not list((server.runtime_dir / "instances").glob("*/*.sock"))


def test_killed_serve_leaves_no_process_behind(tmp_path):
    with running_server(tmp_path, ready=DEFAULT_MODELS) as server:
        family = descendants(server.proc.pid)
        server.proc.kill()
        server.proc.wait(5)
        _gone, alive = psutil.wait_procs(family, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{server.base_url}/healthz", timeout=1)


def test_config_adds_models_and_can_drop_defaults(tmp_path, text_model_dir):
    config = tmp_path / "omnid.toml"
    config.write_text(
        f'default_models = false\n[[models]]\nname = "mine"\npath = "{text_model_dir}"\n'
        'memory = "3GiB"\ncpus = 1.5\npids = 256\n'
    )
    with running_server(tmp_path, "--config", str(config), ready=("mine",)) as server:
        models = httpx.get(f"{server.base_url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["mine"]
        listed = server.omnictl("--json", "models").stdout
        assert '"memory_bytes": 3221225472' in listed and '"cpus": 1.5' in listed


def test_invalid_config_refuses_to_start(tmp_path):
    config = tmp_path / "omnid.toml"
    config.write_text('[[models]]\nname = "x"\npath = "/nonexistent"\n')
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "omni.runtime.omnid",
            "--config",
            str(config),
            "--no-defaults",
            "--runtime-dir",
            str(tmp_path / "run"),
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "/nonexistent: not a directory" in result.stderr
