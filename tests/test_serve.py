"""`omni serve` supervises omnid and the edge: one that dies is started again, the other
keeps running, and Ctrl-C still stops everything."""

from __future__ import annotations

import signal
import sys
import time

import httpx
import psutil
import pytest

from omni import supervise
from omni.supervise import Component, GaveUp

from .conftest import running_server, wait_until


def component(server, module: str) -> psutil.Process:
    """The direct child of `omni serve` that runs `python -m <module>`."""
    children = psutil.Process(server.proc.pid).children()
    found = [p for p in children if module in p.cmdline()]
    assert len(found) == 1, [p.cmdline() for p in children]
    return found[0]


def restarted(server, module: str, old: psutil.Process) -> psutil.Process | None:
    try:
        new = component(server, module)
    except (AssertionError, psutil.NoSuchProcess):
        return None  # not started again yet
    return new if new.pid != old.pid else None


def lists_tiny(server) -> bool:
    try:
        resp = httpx.get(f"{server.base_url}/v1/models", timeout=2)
    except httpx.TransportError:
        return False
    return resp.status_code == 200 and [m["id"] for m in resp.json()["data"]] == ["tiny"]


def edge_healthy(server) -> bool:
    try:
        return httpx.get(f"{server.base_url}/healthz", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_a_killed_component_comes_back_and_ctrl_c_stops_all(tmp_path):
    pytest.importorskip(
        "torch", reason="omni/testing/checkpoints.py writes the tiny model with torch"
    )
    from omni.testing.checkpoints import tiny_llama

    model = tiny_llama(tmp_path / "tiny")
    config = tmp_path / "omnid.toml"
    config.write_text(f'default_models = false\n[[models]]\nname = "tiny"\npath = "{model}"\n')
    with running_server(tmp_path, "--config", str(config)) as server:
        server.wait_ready(["tiny"])  # so that omnid has an instance when it is killed
        wait_until(lambda: lists_tiny(server), 30, "/v1/models through the edge")
        omnid, edge = component(server, "omni.runtime.omnid"), component(server, "edge.server")
        seen = {omnid, edge, *omnid.children(recursive=True)}

        edge.kill()
        new_edge = wait_until(lambda: restarted(server, "edge.server", edge), 10, "a new edge")
        wait_until(lambda: edge_healthy(server) and lists_tiny(server), 10, "the new edge")
        assert component(server, "omni.runtime.omnid").pid == omnid.pid, "omnid restarted"
        seen.add(new_edge)

        argv = omnid.cmdline()
        omnid.kill()
        new_omnid = wait_until(
            lambda: restarted(server, "omni.runtime.omnid", omnid), 10, "a new omnid"
        )
        assert new_omnid.cmdline() == argv  # same port, runtime and data dirs
        wait_until(lambda: lists_tiny(server), 20, "/v1/models through the edge again")
        assert component(server, "edge.server").pid == new_edge.pid, "the edge restarted"
        server.wait_ready(["tiny"])  # the new omnid's instance is stopped with it too
        seen |= {new_omnid, *new_omnid.children(recursive=True)}

        log = server.log()
        assert f"edge (pid {edge.pid}) was killed by SIGKILL" in log, log
        assert f"omnid (pid {omnid.pid}) was killed by SIGKILL" in log, log
        assert "restarting it in 0.5 s" in log, log

        server.stop(signal.SIGINT)  # asserts that no descendant survives
    assert server.proc.returncode == 0
    _gone, alive = psutil.wait_procs(list(seen), timeout=5)
    assert not alive, [p.cmdline() for p in alive]


def exiting(status: int) -> list[str]:
    return [sys.executable, "-c", f"raise SystemExit({status})"]


def nowhere() -> str:
    return "http://127.0.0.1:9/healthz"  # discard port: nothing answers


def test_a_crash_loop_is_given_up_after_five_starts(monkeypatch):
    monkeypatch.setattr(supervise, "BACKOFF_MIN_S", 0.01)
    crashing = Component("omnid", exiting(1), nowhere())
    crashing.start()
    lines = []
    t0 = time.monotonic()
    with pytest.raises(GaveUp, match="last 5 starts never answered"):
        while time.monotonic() - t0 < 20:
            if line := crashing.check():
                lines.append(line)
            time.sleep(0.01)
    assert [line.split("restarting it in ")[1] for line in lines] == [
        "0.01 s",
        "0.02 s",
        "0.04 s",
        "0.08 s",
    ]
    assert all("exited with status 1" in line for line in lines), lines


def test_bad_flags_or_config_are_not_restarted():
    usage = Component("edge", exiting(2), nowhere())
    usage.start()
    usage.proc.wait(10)
    with pytest.raises(GaveUp, match="status 2: bad flags or config"):
        usage.check()


def test_a_start_that_stayed_up_resets_the_backoff(monkeypatch):
    monkeypatch.setattr(supervise, "STABLE_S", 0.0)
    flaky = Component("edge", exiting(1), nowhere(), restarts=4, up=True)
    flaky.start()
    flaky.up = True  # as if /healthz had answered
    flaky.proc.wait(10)
    assert flaky.check().endswith("restarting it in 0.5 s")
