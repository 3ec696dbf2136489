"""An instance split over two ranks (CPU, gloo): the worker starts its other rank as a
child, serves what a one-rank worker serves, and ends when a rank dies."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil

from omni.instance.settings import InstanceSettings
from omni.testing.checkpoints import tiny_llama

from .test_engine import ARCHES, tiny_checkpoint

PROMPT = "t5 t17 t3 t40 t8 t9 t61"


def start(model_dir, socket, tp: int, parallel: str = "tp") -> subprocess.Popen:
    settings = InstanceSettings(
        "tiny", str(model_dir), str(socket), tensor_parallel=tp, parallel=parallel
    )
    env = os.environ | settings.to_env() | {"OMNI_TORCH_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "omni.instance.worker"], env=env)


def complete(socket) -> str:
    async def ask() -> str:
        connector = aiohttp.UnixConnector(path=str(socket))
        async with aiohttp.ClientSession(connector=connector) as session:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
            async with session.post("http://instance/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                return (await resp.json())["choices"][0]["text"]

    return asyncio.run(ask())


def wait_ready(proc, socket, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not socket.exists():
        assert proc.poll() is None, f"worker exited with {proc.returncode}"
        assert time.monotonic() < deadline, "worker not ready"
        time.sleep(0.2)


def test_two_ranks_serve_what_one_serves_and_die_together(tmp_path):
    _, ckpt = tiny_checkpoint(tmp_path / "ckpt", ARCHES["llama"]())
    texts = {}
    for tp in (1, 2):
        socket = tmp_path / f"tp{tp}.sock"
        proc = start(ckpt.path, socket, tp)
        try:
            wait_ready(proc, socket)
            texts[tp] = complete(socket)
            if tp == 2:
                children = {p: " ".join(p.cmdline()) for p in psutil.Process(proc.pid).children()}
                ranks = [
                    p
                    for p, cmd in children.items()
                    if "spawn_main" in cmd and "resource_tracker" not in cmd
                ]
                assert len(ranks) == 1, children  # rank 1, a child of the worker (rank 0)
                ranks[0].send_signal(signal.SIGKILL)
                assert proc.wait(timeout=30) == 1  # the instance ends with its rank
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)
    assert texts[2] == texts[1] and texts[1]


def test_omnid_runs_both_ranks_in_the_instance_sandbox(tmp_path):
    """`tensor_parallel = 2` in the models file: the instance's two ranks are processes of
    one sandbox (the same cgroups), and it serves what one rank serves."""
    from .conftest import running_server

    model = tiny_llama(tmp_path / "tiny")  # world-readable, as sandboxes need
    config = tmp_path / "omnid.toml"
    config.write_text(
        f'default_models = false\n[[models]]\nname = "tiny"\npath = "{model}"\n'
        "tensor_parallel = 2\n"
    )
    (tmp_path / "srv").mkdir()
    with running_server(tmp_path / "srv", "--config", str(config), ready=("tiny",)) as server:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
        import httpx

        resp = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        text = resp.json()["choices"][0]["text"]
        pid = server.instances()["tiny"]["pid"]
        family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        ranks = [p for p in family if "spawn_main" in " ".join(p.cmdline())]
        ranks = [p for p in ranks if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(ranks) == 1, [p.cmdline() for p in family]
        worker = next(p for p in family if "omni.instance.worker" in " ".join(p.cmdline()))
        cgroups = {p.pid: Path(f"/proc/{p.pid}/cgroup").read_text() for p in (worker, ranks[0])}
        assert cgroups[worker.pid] == cgroups[ranks[0].pid]
        assert "omni" in cgroups[worker.pid], cgroups  # the instance's own cgroup
    socket = tmp_path / "one.sock"
    proc = start(model, socket, 1)
    try:
        wait_ready(proc, socket)
        assert complete(socket) == text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_a_mixture_of_experts_with_its_experts_shared_out_serves_what_one_rank_serves(tmp_path):
    """parallel = "ep" in its settings (omnid's `parallel = "ep"`): each rank holds half
    the experts."""
    _, ckpt = tiny_checkpoint(tmp_path / "ckpt", ARCHES["mixtral"]())
    texts = {}
    for tp, parallel in ((1, "tp"), (2, "ep")):
        socket = tmp_path / f"{parallel}.sock"
        proc = start(ckpt.path, socket, tp, parallel)
        try:
            wait_ready(proc, socket)
            texts[parallel] = complete(socket)
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0  # both ranks end cleanly
    assert texts["ep"] == texts["tp"] and texts["tp"]
