"""A node packing 13 instances on one GPU budget that holds 3, on the CPU.

The instances run the CPU engine under the real shim, over the fake CUDA: each
one holds its weights' and KV cache's size in unified memory through the CUDA
runtime, so the shim accounts for it and omnid's swaps move it as on a GPU.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from omni.testing.checkpoints import tiny_llama
from tests.conftest import wait_until
from tests.nodes import Omnid

MODELS = 13
QUOTA = 48 << 20
BUDGET = 3 * QUOTA  # fits 3 of the 13


class Node:
    def __init__(self, log_dir: Path, fake, cold: set[str]):
        # The sandboxes' own uids must reach the models and the fake CUDA: pytest's
        # tmp dirs are 0700, so both go to a world-readable dir.
        tmp = Path(tempfile.mkdtemp(prefix="omni-overcommit-", dir="/tmp"))
        tmp.chmod(0o755)
        self.root = tmp
        libdir = tmp / "cuda"
        shutil.copytree(fake.libdir, libdir, symlinks=True, ignore=shutil.ignore_patterns("shim"))
        libdir.chmod(0o755)
        base = tmp / "models" / "base"
        tiny_llama(base)
        lines = ["request_timeout = 120\n", f'[[gpus]]\nindex = 0\nbudget = "{BUDGET}"\n']
        self.names = [f"m{i:02d}" for i in range(MODELS)]
        for name in self.names:
            shutil.copytree(base, tmp / "models" / name)
            lines.append(
                f'[[models]]\nname = "{name}"\npath = "{tmp / "models" / name}"\n'
                f"gpu = 0\nquota = {QUOTA}\npermits = 4\ncold = {str(name in cold).lower()}\n"
            )
        self.omnid = Omnid(
            log_dir,
            "\n".join(lines),
            "--data-dir",
            str(tmp / "state"),
            env={
                "LD_LIBRARY_PATH": str(libdir),  # the fake CUDA, passed on to instances
                "OMNI_KV_CACHE_BYTES": str(2 << 20),
                "OMNI_TORCH_THREADS": "1",
            },
        )

    def complete(self, model: str, client: httpx.Client | None = None) -> httpx.Response:
        return (client or httpx).post(
            f"{self.omnid.base_url}/v1/completions",
            json={"model": model, "prompt": "t1 t2 t3 t4", "max_tokens": 3, "temperature": 0},
            timeout=180,
        )

    def stop(self) -> None:
        self.omnid.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def node(fake, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overcommit")
    n = Node(tmp, fake, cold={f"m{i:02d}" for i in range(0, MODELS, 2)})

    try:
        n.omnid.wait_ready(n.names, 400)
        yield n
    finally:
        if n.omnid.proc.poll() is None:
            n.stop()


def test_random_traffic_over_13_instances_stays_within_the_budget(node):
    over_budget, samples = [], []
    done = threading.Event()

    def watch():
        while not done.is_set():
            inst = node.omnid.instances()
            charged = [i for i in inst.values() if i["residency"] in ("resident", "moving")]
            used = sum(i["used_bytes"] for i in charged)
            samples.append(len(charged))
            if used > BUDGET or len(charged) > 3:
                over_budget.append({n: i["residency"] for n, i in inst.items()})
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    rng = random.Random(7)
    picks = [rng.choice(node.names) for _ in range(60)]
    try:
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(node.complete, picks))
    finally:
        done.set()
        watcher.join()
    failed = [(m, r.status_code, r.text[:200]) for m, r in zip(picks, responses, strict=True)]
    failed = [f for f in failed if f[1] != 200]
    assert not failed, f"{failed}\n{node.omnid.log()}"
    assert all(len(r.json()["choices"][0]["text"]) > 0 for r in responses)
    assert not over_budget, over_budget[:3]
    assert samples and max(samples) <= 3
    inst = node.omnid.instances()
    assert sum(i["swaps_in"] for i in inst.values()) >= 10
    assert sum(i["swaps_out"] for i in inst.values()) >= 10
    # each swap moved the instance's whole accounted memory, as the shim measured it
    for i in inst.values():
        for swap in i["swap_history"]:
            assert 0 < swap["bytes"] <= QUOTA
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(
            httpx.get(f"{node.omnid.base_url}/metrics").text
        )
        for s in family.samples
    }
    swaps_in = sum(
        v
        for (n, labels), v in samples.items()
        if n == "omni_swaps_total" and ("direction", "in") in labels
    )
    assert swaps_in == sum(i["swaps_in"] for i in inst.values())
    assert samples[("omni_gpu_budget_bytes", (("gpu", "0"),))] == BUDGET
    assert samples[("omni_gpu_resident_quota_bytes", (("gpu", "0"),))] <= BUDGET
    ok = sum(
        v
        for (n, labels), v in samples.items()
        if n == "omni_requests_total" and ("status", "200") in labels
    )
    assert ok >= len(picks)


def test_concurrent_requests_for_a_cold_instance_share_one_swap_in(node):
    """Six requests that reach a swapped-out instance together are served by one swap-in.

    They must overlap: an instance idle for 0.2 s (residency.EVICT_IDLE_S) goes out again,
    and on a loaded 2-core host (CI runs tests side by side) a thread can start its
    request after the others have already been answered, even past a barrier (CI once saw
    two extra swap-ins). So each request records when it was sent and answered, and a
    round whose requests did not all overlap (one sent after another was answered) says
    nothing about sharing and is run again; a round that overlapped must show one swap-in.
    """
    name = node.names[5]
    rounds = []
    for _ in range(5):
        node.omnid.swap_out(name)
        swaps_before = node.omnid.instances()[name]["swaps_in"]
        together = threading.Barrier(6)

        def complete(
            client: httpx.Client, together: threading.Barrier = together
        ) -> tuple[float, float, httpx.Response]:
            together.wait()
            sent = time.monotonic()
            r = client.post(
                f"{node.omnid.base_url}/v1/completions",
                json={
                    "model": name,
                    "prompt": "t1 t2 t3 t4",
                    "max_tokens": 12,
                    "ignore_eos": True,
                    "temperature": 0,
                },
                timeout=180,
            )
            return sent, time.monotonic(), r

        # (clients made first: an SSL context each, under the GIL, spreads the starts)
        with contextlib.ExitStack() as stack, ThreadPoolExecutor(6) as pool:
            clients = [stack.enter_context(httpx.Client()) for _ in range(6)]
            results = list(pool.map(complete, clients))
        assert [r.status_code for _, _, r in results] == [200] * 6
        after = node.omnid.instances()[name]  # (maybe out again: idle, it may go)
        overlapped = max(s for s, _, _ in results) < min(d for _, d, _ in results)
        rounds.append((overlapped, after["swaps_in"] - swaps_before))
        if overlapped:
            assert after["swaps_in"] == swaps_before + 1, rounds
            return
    pytest.fail(f"no round of six requests overlapped on this host: {rounds}")


def test_omnid_asks_an_instance_to_trim_before_its_swap_out(node):
    """POST /trim to the instance (its worker frees its allocator's cache: nothing here,
    on the fake driver), counted by the worker and reported in its memory stats."""
    name = node.names[2]

    def trims() -> int:
        return node.omnid.instances()[name].get("memory", {}).get("memory_trims", -1)

    wait_until(lambda: trims() >= 0, 10, "its memory stats")
    before = trims()  # (as of its last health check: the count can only be higher)
    node.complete(name)  # resident now, until it is swapped out below or, idle, for room
    node.omnid.swap_out(name)  # (or, idle, it went out for room first: trimmed all the same)
    wait_until(lambda: trims() >= before + 1, 10, "the trim in its stats")


def test_admin_swap_errors_are_clear(node):
    """A swap-in of a resident instance is refused (409), as is any swap of an unknown
    one (404). A stream held open keeps it resident: idle, it could go out by itself."""
    name = node.names[1]
    body = {"model": name, "prompt": "t1", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{node.omnid.base_url}/v1/completions", json=body, timeout=180) as r:
        assert r.status_code == 200, r.read()
        next(r.iter_lines())  # its first event: the instance is resident and serving
        with node.omnid.admin() as c:
            refused = c.post(f"/v1/instances/{name}/swap-in")
            assert refused.status_code == 409, refused.text
            assert "resident" in refused.json()["error"]["message"], refused.text
            assert c.post("/v1/instances/nope/swap-out").status_code == 404


def test_an_instance_killed_as_it_comes_back_is_restarted_and_no_request_hangs(node):
    """kill -9 of a swapped-out instance the moment its swap-in begins, its requests
    (long ones) waiting on it or running: each gets an answer (200 once it is back, or a
    clear 502/503), none hangs; the GPU's charge never passes its budget; the instance
    is restarted and serves again."""

    def long_completion() -> httpx.Response:
        body = {"model": name, "prompt": "t1 t2 t3 t4", "max_tokens": 200, "temperature": 0}
        return httpx.post(f"{node.omnid.base_url}/v1/completions", json=body, timeout=180)

    name = node.names[7]
    node.omnid.swap_out(name)
    pid = node.omnid.instances()[name]["pid"]
    os.kill(pid, signal.SIGSTOP)  # its swap-in can begin but not end: killed in the middle
    with ThreadPoolExecutor(4) as pool:
        waiting = [pool.submit(long_completion) for _ in range(4)]
        wait_until(lambda: node.omnid.instances()[name]["residency"] != "swapped", 30, "a swap-in")
        assert not any(f.done() for f in waiting), "answered before the kill"
        os.kill(pid, signal.SIGKILL)
        charged_max = 0
        while not all(f.done() for f in waiting):
            inst = node.omnid.instances()
            charged = [i for i in inst.values() if i["residency"] in ("resident", "moving")]
            charged_max = max(charged_max, len(charged))
            time.sleep(0.05)
        answers = [f.result() for f in waiting]
    statuses = [r.status_code for r in answers]
    assert set(statuses) <= {200, 502, 503}, statuses
    assert all("retry-after" in r.headers for r in answers if r.status_code == 503)
    assert charged_max <= 3
    node.omnid.wait_ready([name], 120)
    assert node.omnid.instances()[name]["pid"] != pid
    assert node.complete(name).status_code == 200
