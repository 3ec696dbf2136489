"""An instance over two GPUs, on the CPU: two ranks in one sandbox, each under the real
shim with its own control block and quota, over the fake CUDA. Its GPUs' pools account
each rank apart, and its ranks go out of (and back into) GPU memory together."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from omni.testing.checkpoints import tiny_llama
from tests.conftest import wait_until
from tests.nodes import Omnid

QUOTA = 48 << 20
BUDGET = 2 * QUOTA  # each GPU holds two instances' quotas


@pytest.fixture(scope="module")
def nodes(fake, tmp_path_factory):
    tmp = Path(tempfile.mkdtemp(prefix="omni-multigpu-", dir="/tmp"))  # sandbox-readable
    tmp.chmod(0o755)
    libdir = tmp / "cuda"
    shutil.copytree(fake.libdir, libdir, symlinks=True, ignore=shutil.ignore_patterns("shim"))
    libdir.chmod(0o755)
    lines = ["request_timeout = 120\n"]
    lines += [f'[[gpus]]\nindex = {i}\nbudget = "{BUDGET}"\n' for i in (0, 1)]
    placements = {"split": "gpu = [0, 1]", "one": "gpu = 1", "two": "gpu = 1"}
    for name, gpu in placements.items():
        tiny_llama(tmp / "models" / name)
        lines.append(
            f'[[models]]\nname = "{name}"\npath = "{tmp / "models" / name}"\n'
            f"{gpu}\nquota = {QUOTA}\ncold = {str(name != 'split').lower()}\n"
        )
    env = {
        "LD_LIBRARY_PATH": str(libdir),
        "OMNI_KV_CACHE_BYTES": str(2 << 20),
        "OMNI_TORCH_THREADS": "1",
    }
    logs = tmp_path_factory.mktemp("multigpu")
    omnid = Omnid(logs, "\n".join(lines), "--data-dir", str(tmp / "state"), env=env)
    # the same node again, on the same runtime dir (what a restarted omnid is)
    omnid.again = lambda: Omnid(  # type: ignore[attr-defined]
        logs,
        "\n".join(lines),
        "--data-dir",
        str(tmp / "state"),
        env=env,
        runtime_dir=omnid.runtime_dir,
    )
    nodes = [omnid]
    try:
        omnid.wait_ready(list(placements), 400)
        yield nodes
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                node.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def complete(node: Omnid, model: str) -> str:
    body = {"model": model, "prompt": "t1 t2 t3 t4", "max_tokens": 4, "temperature": 0}
    resp = httpx.post(f"{node.base_url}/v1/completions", json=body, timeout=180)
    assert resp.status_code == 200, f"{resp.text}\n{node.log()}"
    return resp.json()["choices"][0]["text"]


def ranks(node: Omnid) -> list[dict]:
    return node.instances()["split"]["ranks"]


def settled(node: Omnid) -> dict[str, dict]:
    """The instances once no swap is due: an idle one outside the hot set goes out by
    itself 0.2 s after its last request, so two readings 0.5 s apart must agree."""

    def residencies(inst: dict[str, dict]) -> list:
        return [[r["residency"] for r in i.get("ranks", [i])] for i in inst.values()]

    last = node.instances()
    deadline = time.monotonic() + 30
    while True:
        time.sleep(0.5)
        now = node.instances()
        still = residencies(now) == residencies(last)
        if still and "moving" not in str(residencies(now)):
            return now
        assert time.monotonic() < deadline, f"never settled: {residencies(now)}"
        last = now


def test_each_rank_is_accounted_on_its_own_gpu(nodes):
    node = nodes[-1]
    split = node.instances()["split"]
    assert split["gpus"] == [0, 1] and split["residency"] == "resident"
    by_rank = ranks(node)
    assert [(r["rank"], r["gpu"]) for r in by_rank] == [(0, 0), (1, 1)]
    for r in by_rank:  # each rank's shim counts its own shard and cache, within its quota
        assert 0 < r["used_bytes"] <= QUOTA, by_rank
    with node.admin() as c:
        pools = {p["index"]: p for p in c.get("/v1/node").json()["gpus"]}
    assert "split" in pools[0]["resident"] and "split" in pools[1]["resident"]
    families = text_string_to_metric_families(httpx.get(f"{node.base_url}/metrics").text)
    used = {
        s.labels["gpu"]: s.value
        for f in families
        for s in f.samples
        if s.name == "omni_instance_gpu_memory_used_bytes" and s.labels["model"] == "split"
    }
    assert set(used) == {"0", "1"} and all(v > 0 for v in used.values())


def test_swap_out_and_in_move_both_ranks(nodes):
    node = nodes[-1]
    text = complete(node, "split")
    with node.admin() as c:
        r = c.post("/v1/instances/split/swap-out")
        assert r.status_code == 200, r.text
    wait_until(lambda: all(r["residency"] == "swapped" for r in ranks(node)), 30, "both out")
    assert complete(node, "split") == text  # a request brings both back
    assert all(r["residency"] == "resident" for r in ranks(node))
    assert [r["swaps_in"] for r in ranks(node)] == [1, 1]


def test_room_made_on_one_gpu_takes_the_other_rank_out_too(nodes):
    node = nodes[-1]
    complete(node, "split")
    # until "one" and "two" are worth more than "split" on GPU 1: their demand grows with
    # each request while its decays, but its worth is also its measured swap-in time,
    # which a loaded machine can make many times theirs (no fixed count of rounds)
    deadline = time.monotonic() + 120
    while ranks(node)[1]["residency"] != "swapped":
        assert time.monotonic() < deadline, f"split stayed on GPU 1: {ranks(node)}"
        complete(node, "one")
        complete(node, "two")
    wait_until(lambda: all(r["residency"] == "swapped" for r in ranks(node)), 30, "both out")
    with node.admin() as c:
        pools = {p["index"]: p for p in c.get("/v1/node").json()["gpus"]}
    assert "split" not in pools[0]["resident"]  # its GPU 0 rank left with its GPU 1 rank
    before = [r["swaps_in"] for r in ranks(node)]
    complete(node, "split")
    # both came back for it (read from the counters: idle again, it may go out 0.2 s later)
    assert [r["swaps_in"] for r in ranks(node)] == [n + 1 for n in before]


def test_a_killed_omnid_s_gpu_instances_are_adopted_with_their_memory(nodes):
    """kill -9 of omnid, then a new one: each rank's control block (a sealed memfd its
    sandbox's init holds) is opened again, its residency and use read from it, and a
    request swaps the split model in through them."""
    node = nodes[-1]
    node.swap_out("split")  # out: it must come back through them
    before = settled(node)
    assert [r["residency"] for r in before["split"]["ranks"]] == ["swapped", "swapped"]
    node.proc.kill()
    node.proc.wait()
    again = node.again()
    nodes.append(again)
    again.wait_ready(list(before), 120)
    after = again.instances()
    assert {n: i["pid"] for n, i in after.items()} == {n: i["pid"] for n, i in before.items()}
    for name, inst in after.items():  # where each was, and what it holds, as before
        assert inst["restarts"] == 0
        assert inst["residency"] == before[name]["residency"], name
        assert inst["used_bytes"] == before[name]["used_bytes"] > 0, name
    counts = [r["swaps_in"] for r in ranks(again)]
    complete(again, "split")
    # both ranks came back through their adopted blocks (read from the counters: idle
    # again, it may go out 0.2 s later)
    assert [r["swaps_in"] for r in ranks(again)] == [n + 1 for n in counts]
