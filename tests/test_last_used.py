"""Every instance's last use, the CPU path's too, is the time of its last request: in
`omnictl --json instances`, its table and omnid's dashboard."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx

from omni.testing.checkpoints import tiny_llama
from tests.nodes import Omnid


def test_last_used_is_the_time_of_the_last_request(tmp_path):
    model = tiny_llama(tmp_path / "m")
    config = f'[[models]]\nname = "a"\npath = "{model}"\n[[models]]\nname = "b"\npath = "{model}"\n'
    node = Omnid(tmp_path, config, "--sandbox", "process", env={"OMNI_TORCH_THREADS": "1"})
    try:
        node.wait_ready(["a", "b"])

        def omnictl(*args: str) -> str:
            argv = [sys.executable, "-m", "omni.ctl", "--socket", str(node.socket), *args]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            return done.stdout

        before = json.loads(omnictl("--json", "instances"))["instances"]
        assert [i["last_used"] for i in before] == [None, None]  # none served yet
        t0 = time.time()
        body = {"model": "a", "prompt": "t1 t2", "max_tokens": 2}
        assert httpx.post(f"{node.base_url}/v1/completions", json=body, timeout=60).is_success
        t1 = time.time()

        rows = {i["name"]: i for i in json.loads(omnictl("--json", "instances"))["instances"]}
        assert t0 <= rows["a"]["last_used"] <= t1, (t0, rows["a"]["last_used"], t1)
        assert rows["b"]["last_used"] is None
        table = omnictl("instances").splitlines()
        header, row_a = table[0].split(), next(r.split() for r in table if r.split()[0] == "a")
        assert row_a[header.index("LAST_USED")].endswith("s")  # "0s", not "-"
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(node.socket))) as admin:
            board = admin.get("http://omnid/v1/dashboard", timeout=10).json()
        models = {m["name"]: m for m in board["models"]}
        assert models["a"]["last_used"] == rows["a"]["last_used"]
    finally:
        node.stop()
