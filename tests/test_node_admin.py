"""omnid as a node operator meets it: config, persisted catalog, admin socket, drain."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from omni.engine.checkpoint import CheckpointError
from omni.runtime.catalog import CatalogError, load_config
from omni.runtime.omnid import entry_from_spec
from omni.testing.checkpoints import tiny_llama
from tests.conftest import wait_until
from tests.nodes import Omnid

NOBODY = 65534


def omnid(tmp: Path, config: str, runtime_dir: Path | None = None) -> Omnid:
    return Omnid(tmp, config, "--sandbox", "process", runtime_dir=runtime_dir)


def stop(node: Omnid) -> None:
    assert node.stop() == 0


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return tiny_llama(root / "a"), tiny_llama(root / "b")


def test_catalog_changes_survive_an_omnid_restart(tmp_path, model_dirs):
    a, b = model_dirs
    config = f'state_dir = "{tmp_path / "state"}"\n[[models]]\nname = "a"\npath = "{a}"\n'
    node = omnid(tmp_path, config)
    try:
        assert node.models() == ["a"]
        with node.admin() as c:
            r = c.post("/v1/models", json={"name": "b", "path": str(b), "permits": 2})
            assert r.status_code == 201, r.text
            assert c.delete("/v1/models/a").status_code == 200
        assert node.models() == ["b"]
    finally:
        stop(node)
    saved = json.loads((tmp_path / "state" / "catalog.json").read_text())
    assert list(saved["added"]) == ["b"] and saved["removed"] == ["a"]

    again = omnid(tmp_path, config, node.runtime_dir)  # same config, same state dir
    try:
        assert again.models() == ["b"]
        with again.admin() as c:
            b_entry = c.get("/v1/models").json()["models"][0]
        assert b_entry["permits"] == 2 and b_entry["origin"] == "admin"
    finally:
        stop(again)


def test_the_admin_socket_is_0660_and_checks_who_connects(tmp_path, model_dirs):
    node = omnid(tmp_path, "")
    try:
        node.models()
        assert stat.S_IMODE(node.socket.stat().st_mode) == 0o660
        node.runtime_dir.chmod(0o755)  # as /run/omni is
        os.chmod(node.socket, 0o666)  # let anyone connect: SO_PEERCRED must still refuse
        probe = (  # raw HTTP: nobody cannot read the interpreter's lazily imported modules
            "import os, socket, sys; os.setgid(65534); os.setuid(65534);"
            "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]);"
            "s.sendall(b'GET /v1/models HTTP/1.0\\r\\nHost: omnid\\r\\n\\r\\n');"
            "print(b''.join(iter(lambda: s.recv(4096), b'')).decode())"
        )
        out = subprocess.run(
            [sys.executable, "-c", probe, str(node.socket)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.stdout.startswith("HTTP/1.0 403"), out.stdout + out.stderr
        assert "uid 65534 may not use omnid's admin API" in out.stdout
        with node.admin() as c:
            assert c.get("/v1/models").status_code == 200  # root may
    finally:
        stop(node)


def test_drain_finishes_what_is_in_flight_then_stops_everything(tmp_path, model_dirs):
    a, _ = model_dirs
    node = omnid(tmp_path, f'[[models]]\nname = "a"\npath = "{a}"\n')
    base = node.base_url
    try:
        node.models()
        node.wait_ready(["a"])
        long = {"model": "a", "prompt": "t1 t2", "max_tokens": 200, "stream": True}
        chunks: list[str] = []

        def stream():
            with httpx.stream("POST", f"{base}/v1/completions", json=long, timeout=120) as r:
                for line in r.iter_lines():
                    chunks.append(line)

        reader = threading.Thread(target=stream)
        reader.start()
        wait_until(lambda: len(chunks) > 2, 60, "the stream to start")
        with node.admin() as c:
            assert c.post("/v1/node/drain").status_code == 202
            assert c.get("/v1/node").json()["draining"] is True
        refused = httpx.post(f"{base}/v1/completions", json={"model": "a", "prompt": "t1"})
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        assert refused.json()["error"]["message"].startswith("This node is draining")
        assert httpx.get(f"{base}/healthz").status_code == 503
        reader.join(timeout=120)
        events = [c for c in chunks if c]
        assert events[-1] == "data: [DONE]"  # the request in flight was not cut off
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"

        def stopped():
            with node.admin() as c:
                return c.get("/v1/instances").json()["instances"] == []

        wait_until(stopped, 30, "instances stopped")
    finally:
        stop(node)


def test_an_invalid_config_keeps_omnid_from_starting(tmp_path):
    node = omnid(tmp_path, "[[gpus]]\nindex = 0\nbudget = 'plenty'\n")
    assert node.proc.wait(timeout=60) == 2
    assert "gpus[0].budget: 'plenty' is not a size" in node.log_path.read_text()


def test_a_speculating_model_reports_its_acceptance_in_metrics(tmp_path, model_dirs):
    """`speculative` in the model's table reaches its engine; the verify steps' counters
    come back through the instance's health to omnid's /metrics and /v1/instances."""
    a, _ = model_dirs
    config = f'[[models]]\nname = "a"\npath = "{a}"\nspeculative = {{method = "ngram", k = 3}}\n'
    node = omnid(tmp_path, config)
    try:
        node.wait_ready(["a"])
        prompt = " ".join(["t1 t2 t3 t4"] * 6)  # a repeating text: n-grams to propose
        body = {"model": "a", "prompt": prompt, "max_tokens": 40, "temperature": 0}
        r = httpx.post(f"{node.base_url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text

        def counted() -> dict | None:
            spec = node.instances()["a"].get("speculative") or {}
            return spec if spec.get("spec_steps", 0) > 0 else None

        spec = wait_until(counted, 30, "the instance's speculative counters")
        assert spec["spec_proposed_tokens"] >= spec["spec_accepted_tokens"]
        metrics = httpx.get(f"{node.base_url}/metrics").text
        line = next(m for m in metrics.splitlines() if m.startswith('omni_spec_steps{model="a"}'))
        assert float(line.split()[-1]) == spec["spec_steps"]
    finally:
        stop(node)


def test_a_draft_model_named_in_the_config_drafts_inside_the_sandbox(tmp_path, model_dirs):
    """`speculative = {method = "draft", model = "b"}`: the instance of "a" loads b's
    checkpoint (bound read-only into its sandbox) as its draft, and answers what "a"
    alone answers."""
    a, b = model_dirs
    config = (
        f'[[models]]\nname = "a"\npath = "{a}"\n'
        'speculative = {method = "draft", model = "b", k = 3}\n'
        f'[[models]]\nname = "b"\npath = "{b}"\n'
        f'[[models]]\nname = "plain"\npath = "{a}"\n'
    )
    node = omnid(tmp_path, config)
    try:
        node.wait_ready(["a", "b", "plain"])
        texts = {}
        for name in ("a", "plain"):
            body = {"model": name, "prompt": "t5 t6 t7", "max_tokens": 30, "temperature": 0}
            r = httpx.post(f"{node.base_url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            texts[name] = r.json()["choices"][0]["text"]
        assert texts["a"] == texts["plain"] and len(texts["a"].split()) == 30
        spec = wait_until(
            lambda: (node.instances()["a"].get("speculative") or {}).get("spec_steps") or None,
            30,
            "the draft's verify steps",
        )
        assert spec > 0
    finally:
        stop(node)


def test_a_draft_is_named_by_path_or_by_a_models_entry(tmp_path, model_dirs):
    a, b = model_dirs
    path = tmp_path / "omnid.toml"
    path.write_text(
        f'[[models]]\nname = "a"\npath = "{a}"\n'
        'speculative = {method = "draft", model = "b"}\n'
        f'[[models]]\nname = "b"\npath = "{b}"\n'
    )
    (entry, _) = load_config(path).models
    assert dict(entry.placement.speculative) == {"method": "draft", "path": str(b.resolve())}
    assert entry.placement.draft_path == b.resolve()
    for table, message in (
        ("{method = 'draft', model = 'zz'}", "speculative.model 'zz' is no \\[\\[models\\]\\]"),
        ("{method = 'draft', model = 'a'}", "cannot be its own draft"),
        ("{method = 'ngram', model = 'b'}", "only with method = 'draft'"),
        ("{method = 'draft'}", "needs its checkpoint's absolute path"),
        ("{method = 'eagle3', path = 'rel/dir'}", "needs its checkpoint's absolute path"),
        ("{method = 'ngram', path = '/x'}", "'ngram' loads no weights"),
        ("{method = 'mtp', path = '/x'}", "'mtp' reads the model's own checkpoint"),
    ):
        path.write_text(
            f'[[models]]\nname = "a"\npath = "{a}"\nspeculative = {table}\n'
            f'[[models]]\nname = "b"\npath = "{b}"\n'
        )
        with pytest.raises(CatalogError, match=message):
            load_config(path)
    spec = {"path": str(a), "speculative": {"method": "eagle3", "path": str(tmp_path)}}
    with pytest.raises(CheckpointError, match="an EAGLE-3 head"):
        entry_from_spec("x", spec)
    spec["speculative"] = {"method": "mtp"}  # (a Llama: no multi-token-prediction layer)
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers"):
        entry_from_spec("x", spec)
    spec["speculative"] = {"method": "draft", "model": "b"}
    with pytest.raises(CatalogError, match="give the draft checkpoint's 'path'"):
        entry_from_spec("x", spec)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_kv_tier_brings_an_evicted_prompt_back(tmp_path, model_dirs, tier):
    """`kv_host_cache` (and `kv_disk_cache` under it) reach the engine: with a pool of 8
    blocks, other prompts evict the first one's blocks; asked again, it is a prefix hit
    from host memory, or from the disk below a host tier of two blocks (usage's
    cached_tokens), counted in /v1/instances and /metrics."""
    a, _ = model_dirs
    config = f'state_dir = "{tmp_path / "state"}"\n[[models]]\nname = "a"\npath = "{a}"\n'
    config += {
        "host": 'kv_host_cache = "16MiB"\n',
        "disk": 'kv_host_cache = "16KiB"\nkv_disk_cache = "16MiB"\n',
    }[tier]
    node = Omnid(
        tmp_path, config, "--sandbox", "process", env={"OMNI_KV_CACHE_BYTES": str(8 << 13)}
    )
    try:
        node.wait_ready(["a"])

        def complete(prompt: str) -> dict:
            body = {"model": "a", "prompt": prompt, "max_tokens": 2, "temperature": 0}
            r = httpx.post(f"{node.base_url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["usage"]

        first = " ".join(f"t{i}" for i in range(1, 50))
        assert complete(first)["prompt_tokens_details"]["cached_tokens"] == 0
        for k in range(3):  # 49 tokens each: the 8-block pool cannot keep the first too
            complete(" ".join(f"t{50 + 20 * k + i % 20}" for i in range(49)))
        usage = complete(first)
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 32, usage

        restored = f"kv_{tier}_restored_blocks"

        def counted() -> dict | None:
            counters = node.instances()["a"].get(f"kv_{tier}") or {}
            return counters if counters.get(restored, 0) > 0 else None

        counters = wait_until(counted, 30, f"the instance's {tier}-tier counters")
        metrics = httpx.get(f"{node.base_url}/metrics").text
        line = next(m for m in metrics.splitlines() if m.startswith(f"omni_{restored}"))
        assert float(line.split()[-1]) == counters[restored]
        if tier == "disk":  # its own directory, in the state dir
            assert list((tmp_path / "state" / "kv-disk" / "a").glob("*.kv"))
    finally:
        stop(node)
    assert not (tmp_path / "state" / "kv-disk" / "a").exists()  # gone with the instance


def test_a_bad_speculative_table_is_refused(tmp_path):
    path = tmp_path / "omnid.toml"
    for table, message in (
        ("{method = 'eagle9'}", "'eagle9' is not one of"),
        ("{k = 0}", "k must be 1 to 16"),
        ("{k = '4'}", "k must be an integer"),
        ("{depth = 2}", "unknown key 'depth'"),
        ("4", "a table"),
    ):
        path.write_text(f"[[models]]\nname = 'x'\npath = '/x'\nspeculative = {table}\n")
        with pytest.raises(CatalogError, match=message):
            load_config(path)
