"""Which sandbox limits hold on a node, where an operator sees it (/v1/node, `omnictl node`,
/metrics), the config's `require_limits` that refuses to start instances without them,
and the cgroup directories omnid leaves behind (none)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from omni.isolation import cgroups
from omni.isolation.cgroups import CgroupManager
from omni.isolation.sandbox import Limits
from omni.runtime.catalog import CatalogError, load_config
from omni.runtime.omnid import Node, admin_app, sandbox_factory
from omni.testing.checkpoints import tiny_llama
from tests.nodes import Omnid

ALL = ["memory", "cpu", "pids", "tmp", "io", "seccomp"]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("models") / "a")


def omnictl_node(socket: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "omni.ctl", "--socket", str(socket), "node"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def gauges(metrics: str) -> dict[str, float]:
    """omni_sandbox_limit_enforced's value per limit."""
    prefix = 'omni_sandbox_limit_enforced{limit="'
    return {
        line[len(prefix) :].split('"')[0]: float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith(prefix)
    }


def scope_dirs(runtime_dir: Path) -> list[Path]:
    """The cgroup directories of the omnid of `runtime_dir`, in every hierarchy."""
    scope = hashlib.sha1(str(runtime_dir.resolve()).encode()).hexdigest()[:12]
    return sorted(Path("/sys/fs/cgroup").rglob(scope))


def test_require_limits_takes_the_sandbox_limits_by_name(tmp_path):
    path = tmp_path / "omnid.toml"
    path.write_text('require_limits = ["cpu", "seccomp", "cpu"]\n')
    assert load_config(path).require_limits == ("cpu", "seccomp")
    path.write_text("")
    assert load_config(path).require_limits == ()
    for value, message in (
        ('["cpu", "gpu"]', "'require_limits': 'gpu' is not one of"),
        ('"cpu"', "'require_limits' must be a list of names"),
        ("[1]", "'require_limits' must be a list of names"),
    ):
        path.write_text(f"require_limits = {value}\n")
        with pytest.raises(CatalogError, match=message):
            load_config(path)


def test_a_v2_scope_without_cpu_reports_cpu_unenforced(tmp_path, monkeypatch, caplog):
    """v2 (the lent GPU host): what the scope enables for its groups is what holds."""
    (tmp_path / "cgroup.subtree_control").write_text("memory pids\n")
    monkeypatch.setattr(cgroups, "_warned", set())
    assert CgroupManager(2, {"": tmp_path}).enforced() == {
        "memory": True,
        "cpu": False,
        "pids": True,
    }
    assert "cpu controller not delegated: CPU quota and weight not enforced" in caplog.text


CLIENT = """
import json, sys, httpx
method, socket, path, body = sys.argv[1:]
transport = httpx.HTTPTransport(uds=socket)
with httpx.Client(transport=transport, base_url="http://omnid") as client:
    r = client.request(method, path, json=json.loads(body))
print(r.status_code, r.text)
"""


async def admin_call(node: Node, socket: Path, method: str, path: str, body=None):
    """(status, JSON body) of one admin request, from another process: omnid refuses
    its own."""
    runner = web.AppRunner(admin_app(node))
    await runner.setup()
    await web.UnixSite(runner, str(socket)).start()
    try:
        args = [method, str(socket), path, json.dumps(body)]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CLIENT, *args, stdout=asyncio.subprocess.PIPE
        )
        out, _ = await proc.communicate()
    finally:
        await runner.cleanup()
    status, text = out.decode().split(" ", 1)
    return int(status), json.loads(text)


@needs_root
def test_a_required_limit_the_host_lacks_refuses_loads(tmp_path, model, monkeypatch):
    """The real factory on this host's cgroups, told by enforced() that cpu does not hold
    (as on the lent GPU host): loads are refused with the reason, and /v1/node says it."""
    monkeypatch.setattr(
        CgroupManager, "enforced", lambda self: {"memory": True, "cpu": False, "pids": True}
    )
    runtime = Path(tempfile.mkdtemp(prefix="omni-lim-", dir="/tmp"))

    async def go():
        node = Node(runtime)
        _factory, groups = sandbox_factory("isolated", runtime, node, ("memory", "cpu"))
        try:
            socket = runtime / "admin.sock"
            load = await admin_call(
                node, socket, "POST", "/v1/models", {"name": "a", "path": str(model)}
            )
            _, status = await admin_call(node, socket, "GET", "/v1/node")
            return load, status, node.metrics.render().decode(), node.instances
        finally:
            groups.close()

    try:
        load, status, metrics, instances = asyncio.run(go())
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    assert load[0] == 503, load
    error = load[1]["error"]
    assert error["code"] == "sandbox_limits_unmet" and "cpu (require_limits)" in error["message"]
    assert error["type"] == "service_unavailable_error"
    assert instances == {}
    sandbox = status["sandbox"]
    assert sandbox["mode"] == "isolated" and sandbox["enforced"]["cpu"] is False
    assert sandbox["required"] == ["memory", "cpu"] and sandbox["missing"] == ["cpu"]
    assert gauges(metrics)["cpu"] == 0 and gauges(metrics)["memory"] == 1


def test_in_plain_process_mode_nothing_holds_and_required_limits_refuse(tmp_path, model):
    """Plain processes (--sandbox process, as a non-root omnid runs) enforce nothing: with
    `require_limits`, omnid starts and serves its APIs, but starts no instance."""
    config = f'require_limits = ["memory"]\n[[models]]\nname = "a"\npath = "{model}"\n'
    node = Omnid(tmp_path, config, "--sandbox", "process")
    try:
        assert node.models() == []  # the configured model was not started
        with node.admin() as c:
            sandbox = c.get("/v1/node").json()["sandbox"]
            load = c.post("/v1/models", json={"name": "b", "path": str(model)})
        assert sandbox == {
            "mode": "process",
            "cgroup_version": None,
            "seccomp": False,
            "enforced": dict.fromkeys(ALL[:-1], False),
            "required": ["memory"],
            "missing": ["memory"],
        }
        assert load.status_code == 503
        assert load.json()["error"]["message"] == (
            "This node does not enforce the sandbox limits its config requires: "
            "memory (require_limits); no instance is started here."
        )
        shown = omnictl_node(node.socket)
        assert "sandbox: process; enforced: -; NOT enforced: memory, cpu" in shown
        assert "required but NOT enforced: memory (require_limits): no instance starts" in shown
        metrics = httpx.get(f"{node.base_url}/metrics").text
        assert gauges(metrics) == dict.fromkeys(ALL, 0.0)
    finally:
        assert node.stop() == 0
    assert "model a not started: This node does not enforce" in node.log_path.read_text()


def host_enforces() -> dict[str, bool]:
    """What this host's cgroups enforce (the lent GPU host delegates memory alone)."""
    groups = CgroupManager.detect(f"probe-{os.getpid()}")
    try:
        return {**groups.enforced(), "tmp": True, "io": True}
    finally:
        groups.close()


@needs_root
def test_an_isolated_node_enforces_what_the_host_delegates_and_leaves_no_cgroups(tmp_path, model):
    """As root on this host: a node that requires every limit the host can enforce (and
    seccomp) serves and says which hold; once it stops, its cgroup scope is gone."""
    held = host_enforces()
    required = [k for k in ALL if k == "seccomp" or held[k]]
    config = f'require_limits = {required}\n[[models]]\nname = "a"\npath = "{model}"\n'
    node = Omnid(tmp_path, config)
    try:
        node.wait_ready(["a"])
        with node.admin() as c:
            sandbox = c.get("/v1/node").json()["sandbox"]
        version = 2 if Path("/sys/fs/cgroup/cgroup.controllers").exists() else 1
        assert sandbox == {
            "mode": "isolated",
            "cgroup_version": version,
            "seccomp": True,
            "enforced": {k: held[k] for k in ALL[:-1]},
            "required": required,
            "missing": [],
        }
        on = ", ".join(k for k in ALL[:-1] if held[k])
        off = ", ".join(k for k in ALL[:-1] if not held[k]) or "-"
        assert omnictl_node(node.socket).splitlines()[1] == (
            f"sandbox: isolated (cgroup v{version}, seccomp on); "
            f"enforced: {on}; NOT enforced: {off}"
        )
        expected = {k: float(held.get(k, True)) for k in ALL}
        assert gauges(httpx.get(f"{node.base_url}/metrics").text) == expected
        scopes = scope_dirs(node.runtime_dir)
        assert scopes and all((s / "a").is_dir() for s in scopes)  # the instance's group
    finally:
        assert node.stop() == 0
    assert [s for s in scopes if s.exists()] == []
    assert scope_dirs(node.runtime_dir) == []


@needs_root
def test_close_destroys_what_is_left_and_removes_the_scope():
    """A group whose stop failed is destroyed with its processes; then the scope goes, in
    every hierarchy (as the escape fixture and the sandbox bench close theirs)."""
    groups = CgroupManager.detect(f"close-{os.getpid()}")
    scopes = sorted(set(groups.base.values()))
    stopped = groups.create("stopped", Limits(memory_bytes=64 << 20, pids=16))
    left = groups.create("left", Limits(memory_bytes=64 << 20, pids=16))
    stopped.destroy()
    proc = subprocess.Popen(["sleep", "600"])
    try:
        for path in left.join_files():
            Path(path).write_text(str(proc.pid))
        groups.close()
        assert proc.wait(timeout=10) == -9
    finally:
        proc.kill()
    assert [s for s in scopes if s.exists()] == []
