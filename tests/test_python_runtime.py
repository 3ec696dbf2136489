"""Third-party handlers served by a real omnid (`runtime = "python"`), in plain processes
and, as root, in the isolated sandbox: the Open Inference Protocol through omnid's /v2,
dynamic batching counted in omnid's metrics, and hostile handlers (a wrong shape, a huge
output, an exception, a hang, an exit, a read of another model's files) that get clear
errors and the usual restart, never a hung request, and are contained."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import wait_until
from tests.nodes import Omnid

HANDLERS = '''
import importlib
import os
import threading
import time

import numpy as np

from omni.instance.handler import Handler, HandlerError, TensorSpec


class AddOne(Handler):
    """Adds 1 to x, echoes s, and says how many requests its batch held."""

    inputs = (TensorSpec("x", "FP32", (-1,)), TensorSpec("s", "BYTES", (1,)))
    outputs = (
        TensorSpec("y", "FP32", (-1,)),
        TensorSpec("s", "BYTES", (1,)),
        TensorSpec("batch", "INT32", (1,)),
    )
    max_batch_size = 8
    max_queue_delay_ms = 300

    def load(self, model_dir, device):
        self.device = device
        self.offset = float((model_dir / "offset.txt").read_text())

    def infer(self, batch):
        for request in batch:
            if (request["x"] < 0).any():
                raise HandlerError("x must not be negative")
        n = np.array([len(batch)], dtype=np.int32)
        return [{"y": r["x"] + self.offset, "s": r["s"], "batch": n} for r in batch]


class WrongShape(AddOne):
    def infer(self, batch):
        return [{"y": np.zeros((2, 2), np.float32), "s": r["s"], "batch": np.zeros(1, np.int32)}
                for r in batch]


class Huge(AddOne):
    def infer(self, batch):
        return [{"y": np.zeros(20 << 20, np.float32), "s": r["s"], "batch": np.zeros(1, np.int32)}
                for r in batch]


class Raises(AddOne):
    def infer(self, batch):
        raise RuntimeError("the model fell over")


class Hangs(AddOne):
    def infer(self, batch):
        threading.Event().wait()


class Exits(AddOne):
    def infer(self, batch):
        os._exit(3)


class Snoop(AddOne):
    """Opens the file each request names (another model's), or imports the module it
    names ("import:NAME"), and says what happened."""

    def infer(self, batch):
        out = []
        for r in batch:
            target = r["s"][0].decode()
            try:
                if target.startswith("import:"):
                    importlib.import_module(target.removeprefix("import:"))
                    said = b"imported"
                else:
                    with open(target, "rb") as f:
                        said = b"read: " + f.read(64)
            except (OSError, ImportError) as exc:
                said = type(exc).__name__.encode()
            s = np.empty(1, dtype=object)
            s[0] = said
            out.append({"y": r["x"], "s": s, "batch": np.ones(1, np.int32)})
        return out


class Slow(AddOne):
    max_batch_size = 1

    def infer(self, batch):
        time.sleep(1.5)
        return super().infer(batch)
'''

HOSTILE = ("wrong-shape", "huge", "raises", "hangs", "exits")


def handler_dir(path: Path) -> Path:
    (path / "handler.py").write_text(HANDLERS)
    (path / "offset.txt").write_text("1.0\n")
    for p in (path, *path.iterdir()):  # world-readable, as sandboxes need
        p.chmod(0o755 if p.is_dir() else 0o644)
    path.parent.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return handler_dir(tmp_path_factory.mktemp("handler-model"))


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> Path:
    """Another model's directory, with a file only that model's sandbox may read."""
    path = tmp_path_factory.mktemp("other-model")
    (path / "secret.txt").write_text("the other model's weights\n")
    return handler_dir(path)


def config(model: Path, other: Path) -> str:
    entries = [
        ("add", "AddOne", ""),
        ("wrong-shape", "WrongShape", ""),
        ("huge", "Huge", ""),
        ("raises", "Raises", ""),
        ("hangs", "Hangs", "infer_timeout = 1\n"),
        ("exits", "Exits", ""),
        ("slow", "Slow", ""),
        ("snoop", "Snoop", ""),
    ]
    out = ""
    for name, cls, extra in [*entries, ("other", "AddOne", f'path = "{other}"\n')]:
        path = "" if "path" in extra else f'path = "{model}"\n'
        out += f'[[models]]\nname = "{name}"\n{path}runtime = "python"\n'
        out += f'handler = "handler.py:{cls}"\nmemory = "2GiB"\n{extra}'
    return out


SANDBOXES = [
    "process",
    pytest.param(
        "isolated",
        marks=pytest.mark.skipif(os.geteuid() != 0, reason="the isolated sandbox needs root"),
    ),
]


@pytest.fixture(scope="module", params=SANDBOXES)
def node(request, tmp_path_factory, model_dir, other_model_dir):
    text = config(model_dir, other_model_dir)
    omnid = Omnid(tmp_path_factory.mktemp("node"), text, "--sandbox", request.param)
    omnid.sandbox_kind = request.param
    try:
        omnid.models()
        omnid.wait_ready(["add", "slow", "snoop", "other", *HOSTILE], timeout_s=180)
        yield omnid
    finally:
        assert omnid.stop() == 0, omnid.log()


def infer_body(values: list[float], text: str = "hi") -> dict:
    return {
        "id": "r1",
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [len(values)], "data": values},
            {"name": "s", "datatype": "BYTES", "shape": [1], "data": [text]},
        ],
    }


def infer(node: Omnid, model: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{node.base_url}/v2/models/{model}/infer", json=body, timeout=timeout)


def outputs(resp: httpx.Response) -> dict:
    assert resp.status_code == 200, resp.text
    return {o["name"]: o["data"] for o in resp.json()["outputs"]}


def test_a_handler_in_the_model_directory_serves_the_protocol(node):
    meta = httpx.get(f"{node.base_url}/v2/models/add", timeout=30)
    assert meta.status_code == 200, meta.text
    meta = meta.json()
    assert meta["platform"] == "omni-python"
    assert meta["inputs"] == [
        {"name": "x", "datatype": "FP32", "shape": [-1]},
        {"name": "s", "datatype": "BYTES", "shape": [1]},
    ]
    assert [o["name"] for o in meta["outputs"]] == ["y", "s", "batch"]
    assert httpx.get(f"{node.base_url}/v2/models/add/ready", timeout=30).status_code == 200
    resp = infer(node, "add", infer_body([1.0, 2.5, -0.5 + 1], "héllo"))
    got = outputs(resp)
    assert got["y"] == [2.0, 3.5, 1.5]  # + the offset its load() read from its directory
    assert got["s"] == ["héllo"] and resp.json()["id"] == "r1"


def test_bad_requests_get_400s_that_say_why(node):
    missing = infer(node, "add", {"inputs": [infer_body([1.0])["inputs"][0]]})
    assert missing.status_code == 400 and "missing input 's'" in missing.json()["error"]
    refused = infer(node, "add", infer_body([-1.0]))
    assert refused.status_code == 400 and "x must not be negative" in refused.json()["error"]


def test_concurrent_requests_are_batched_and_answered_each_on_its_own(node):
    before = node.instances()["add"].get("batching", {})
    with ThreadPoolExecutor(8) as pool:
        resps = list(pool.map(lambda i: infer(node, "add", infer_body([i, i])), range(8)))
    got = [outputs(r) for r in resps]
    for i, out in enumerate(got):  # each its own answer, whatever its batch-mates
        assert out["y"] == [i + 1.0, i + 1.0]
    assert max(out["batch"][0] for out in got) > 1, [out["batch"] for out in got]
    alone = outputs(infer(node, "add", infer_body([3, 3])))
    assert alone["y"] == got[3]["y"] and alone["batch"] == [1]

    def counted():
        stats = node.instances()["add"].get("batching", {})
        done = stats.get("batch_requests", 0) - before.get("batch_requests", 0)
        return stats if done >= 9 else None

    stats = wait_until(counted, 10, "the batches in omnid's instance stats")
    assert stats["batch_runs"] - before.get("batch_runs", 0) < 9  # some were merged
    metrics = httpx.get(f"{node.base_url}/metrics", timeout=30).text
    assert 'omni_batch_requests{model="add"}' in metrics
    assert 'omni_memory_read_only_bytes{model="add"} 0.0' in metrics  # (the CPU: none)
    sizes = [line for line in metrics.splitlines() if line.startswith("omni_batch_size_batches")]
    assert any('model="add"' in s and 'size="1"' not in s for s in sizes), sizes


def test_a_request_whose_client_left_is_dropped_before_it_runs(node):
    """The client of a queued request disconnects: omnid cancels its relay, and the
    instance drops the request instead of running it."""
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(infer, node, "slow", infer_body([1.0]))
        time.sleep(0.5)  # (it is in infer() now, for 1.5 s)
        with pytest.raises(httpx.TimeoutException):
            infer(node, "slow", infer_body([2.0]), timeout=0.5)  # queued behind it, then gone
        assert outputs(running.result())["y"] == [2.0]

    def counted():
        stats = node.instances()["slow"].get("batching", {})
        return stats if stats.get("batch_cancelled") else None

    stats = wait_until(counted, 15, "the dropped request in the instance's stats")
    time.sleep(2)  # had it run, it would have by now
    stats = node.instances()["slow"]["batching"]
    assert (stats["batch_runs"], stats["batch_cancelled"]) == (1, 1), stats
    # its memory (on the CPU: no weights declared read-only, no trims) is reported beside
    memory = {"memory_read_only_bytes": 0, "memory_trims": 0, "memory_trimmed_bytes": 0}
    assert node.instances()["slow"]["memory"] == memory


@pytest.mark.parametrize(
    ("model", "status", "says"),
    [
        ("wrong-shape", 500, "'y' has shape [2, 2], not [-1]"),
        ("huge", 500, "byte limit of a response"),
        ("raises", 500, "RuntimeError: the model fell over"),
    ],
)
def test_a_hostile_handler_gets_a_clear_error_and_keeps_serving(node, model, status, says):
    for _ in range(2):  # the instance is still there for the next request
        t0 = time.monotonic()
        resp = infer(node, model, infer_body([1.0]))
        took = time.monotonic() - t0
        assert resp.status_code == status and says in resp.json()["error"], resp.text
        assert took < 30, took
    inst = node.instances()[model]
    assert inst["state"] == "ready" and inst["restarts"] == 0, inst


def test_a_handler_cannot_read_another_model_s_files(node, model_dir, other_model_dir):
    secret = other_model_dir / "secret.txt"
    said = outputs(infer(node, "snoop", infer_body([1.0], str(secret))))["s"][0]
    if node.sandbox_kind == "isolated":  # only its own model directory is in its view
        assert said in ("FileNotFoundError", "PermissionError"), said
    else:  # a plain process reads what its uid may: the isolated sandbox is the boundary
        assert said == "read: the other model's weights\n", said
    own = outputs(infer(node, "snoop", infer_body([1.0], str(model_dir / "offset.txt"))))
    assert own["s"][0] == "read: 1.0\n", own  # its own, it reads


def test_a_third_party_handler_sees_the_shared_base_alone_of_omnid_s_packages(node):
    def tried(module: str) -> str:
        return outputs(infer(node, "snoop", infer_body([1.0], f"import:{module}")))["s"][0]

    assert tried("numpy") == "imported"  # the shared base
    if node.sandbox_kind == "isolated":  # the rest of omnid's environment is not in its view
        assert tried("transformers") == "ModuleNotFoundError"
        assert tried("pocketsphinx") == "ModuleNotFoundError"


def test_a_hung_handler_times_out_and_is_restarted(node):
    restarts = node.instances()["hangs"]["restarts"]
    t0 = time.monotonic()
    resp = infer(node, "hangs", infer_body([1.0]))
    assert time.monotonic() - t0 < 30
    assert resp.status_code == 504 and "1 s timeout" in resp.json()["error"], resp.text

    def restarted():
        inst = node.instances()["hangs"]
        return inst["restarts"] > restarts and inst["state"] == "ready"

    wait_until(restarted, 60, f"the hung instance restarted; log:\n{node.log()}", 0.5)


def test_a_handler_that_exits_fails_its_request_and_is_restarted(node):
    restarts = node.instances()["exits"]["restarts"]
    t0 = time.monotonic()
    resp = infer(node, "exits", infer_body([1.0]))
    assert time.monotonic() - t0 < 30
    assert resp.status_code in (502, 503), resp.text
    assert resp.json()["error"], resp.text

    def restarted():
        inst = node.instances()["exits"]
        return inst["restarts"] > restarts and inst["state"] == "ready"

    wait_until(restarted, 60, "the instance restarted", 0.5)
    assert "exit" in (node.instances()["exits"]["last_exit"] or "")


def test_the_instance_is_told_its_settings_in_one_document(node):
    """omnid passes what it serves in OMNI_INSTANCE_SETTINGS, none of the old variables."""
    pid = node.instances()["add"]["pid"]
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    names = {e.split(b"=", 1)[0].decode() for e in env if e}
    assert "OMNI_INSTANCE_SETTINGS" in names
    assert not names & {"OMNI_TOOL_PARSER", "OMNI_TENSOR_PARALLEL", "OMNI_KV_DISK"}


VERSIONED = """
import numpy as np
import omni_testpkg

from omni.instance.handler import Handler, TensorSpec


class Version(Handler):
    outputs = (TensorSpec("version", "BYTES", (1,)),)
    inputs = (TensorSpec("x", "FP32", (1,)),)

    def infer(self, batch):
        out = np.empty(1, dtype=object)
        out[0] = omni_testpkg.VERSION.encode()
        return [{"version": out} for _ in batch]
"""


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_two_models_pinning_conflicting_versions_serve_side_by_side(tmp_path, sandbox):
    """Each model's own packages, from a local wheelhouse, are first on its path alone;
    a model without requirements does not see them. Also loaded through `omnictl load`."""
    from tests.wheels import write_wheel

    house = tmp_path / "wheelhouse"
    house.mkdir()
    write_wheel(house, "omni_testpkg", "1.0.0")
    write_wheel(house, "omni_testpkg", "2.0.0")
    model = tmp_path / "model"
    model.mkdir()
    (model / "handler.py").write_text(VERSIONED)
    for p in (tmp_path, model, house, *model.iterdir(), *house.iterdir()):
        p.chmod(0o755 if p.is_dir() else 0o644)
    text = f'wheelhouse = "{house}"\n'
    for name, version in (("v1", "1.0.0"), ("v2", "2.0.0")):
        text += f'[[models]]\nname = "{name}"\npath = "{model}"\nruntime = "python"\n'
        text += f'handler = "handler.py:Version"\nrequirements = ["omni_testpkg=={version}"]\n'
    node = Omnid(tmp_path, text, "--sandbox", sandbox)
    try:
        node.models()
        node.wait_ready(["v1", "v2"], timeout_s=180)
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [0]}]}
        for name, version in (("v1", "1.0.0"), ("v2", "2.0.0")):
            assert outputs(infer(node, name, body))["version"] == [version]
        loaded = node_omnictl(node, "load", "bare", str(model), "--runtime", "python")
        assert loaded.returncode != 0 and "handler" in loaded.stderr + loaded.stdout
        loaded = node_omnictl(
            node,
            "load",
            "bare",
            str(model),
            "--runtime",
            "python",
            "--handler",
            "handler.py:Version",
        )
        assert loaded.returncode == 0, loaded.stderr
        wait_until(
            lambda: node.instances()["bare"]["state"] in ("backoff", "failed"),
            60,
            "the model without its package to fail to start",
        )
        said = (node.instances()["bare"]["last_exit"] or "") + node.log()
        assert "No module named 'omni_testpkg'" in said
    finally:
        assert node.stop() == 0, node.log()


def node_omnictl(node: Omnid, *args: str):
    import subprocess
    import sys

    argv = [sys.executable, "-m", "omni.ctl", "--socket", str(node.socket), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)
