"""The edge in front of a real omnid (CPU engine): keys, rate limits, tenants, deadlines."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from edge.tenants import hash_key
from omni.testing.checkpoints import tiny_llama
from tests.conftest import free_port, wait_until
from tests.nodes import Omnid

KEYS = {"acme": "sk-acme-0123456789", "globex": "sk-globex-9876543210", "slow": "sk-slow-42"}


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("edge")
    model = tiny_llama(tmp / "tiny")
    tenants = "".join(
        f'[[tenants]]\nname = "{name}"\nweight = 1\nkeys = ["{hash_key(key)}"]\n'
        + ("requests_per_minute = 2\n" if name == "slow" else "")
        for name, key in KEYS.items()
    )
    (tmp / "tenants.toml").write_text(tenants)
    omnid = Omnid(
        tmp, f'[[models]]\nname = "tiny"\npath = "{model}"\npermits = 1\n', "--sandbox", "process"
    )
    edge_port = free_port()
    edge_argv = ["-m", "edge.server", "--port", str(edge_port), "--upstream", omnid.base_url]
    edge_proc = subprocess.Popen(
        [sys.executable, *edge_argv, "--tenants", str(tmp / "tenants.toml")],
        stdout=(tmp / "edge.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    procs = [omnid.proc, edge_proc]
    base = f"http://127.0.0.1:{edge_port}"

    def serving():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(
                    (tmp / "omnid.log").read_text() + (tmp / "edge.log").read_text()
                )
        try:
            r = httpx.post(
                f"{base}/v1/completions",
                json={"model": "tiny", "prompt": "t1", "max_tokens": 1},
                headers=auth("acme"),
                timeout=10,
            )
            return r.status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(serving, 120, "the edge serving tiny", interval_s=0.5)
        yield base, tmp, omnid
    finally:
        edge_proc.terminate()
        edge_proc.wait(timeout=30)
        omnid.stop()


def auth(tenant: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def permits_in_use(base: str) -> float:
    """The edge's permits held for the test model, from its /metrics."""
    page = httpx.get(f"{base}/metrics").text
    found = re.search(r'^omni_edge_permits_in_use\{model="tiny"\} (\S+)$', page, re.M)
    return float(found.group(1)) if found else 0.0


def complete(base, tenant, **body) -> httpx.Response:
    body = {"model": "tiny", "prompt": "t1 t2", "max_tokens": 2, **body}
    return httpx.post(f"{base}/v1/completions", json=body, headers=auth(tenant), timeout=60)


def test_requests_need_a_valid_key_which_is_never_logged(edge):
    base, tmp, _ = edge
    body = {"model": "tiny", "prompt": "t1", "max_tokens": 1}
    missing = httpx.post(f"{base}/v1/completions", json=body)
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.post(
        f"{base}/v1/completions", json=body, headers={"Authorization": "Bearer sk-nope-123"}
    )
    assert wrong.status_code == 401 and "sk-nope-123" not in wrong.text
    assert httpx.get(f"{base}/v1/models").status_code == 401
    assert httpx.get(f"{base}/v1/models", headers=auth("acme")).json()["data"][0]["id"] == "tiny"
    assert complete(base, "acme").status_code == 200
    logs = (tmp / "edge.log").read_text() + (tmp / "omnid.log").read_text()
    assert not any(key in logs for key in [*KEYS.values(), "sk-nope-123"])


def test_a_tenant_over_its_rate_limit_gets_429_with_retry_after(edge):
    base, *_ = edge
    codes = [complete(base, "slow") for _ in range(3)]
    assert [r.status_code for r in codes[:2]] == [200, 200]
    assert codes[2].status_code == 429
    assert int(codes[2].headers["Retry-After"]) >= 1
    assert codes[2].json()["error"]["code"] == "rate_limit_exceeded"
    assert complete(base, "acme").status_code == 200  # other tenants are not limited


def test_prefix_caches_are_per_tenant_through_the_edge(edge):
    base, *_ = edge
    prompt = " ".join(f"t{i % 90 + 1}" for i in range(80))  # five full 16-token blocks
    first = complete(base, "acme", prompt=prompt, max_tokens=1)
    again = complete(base, "acme", prompt=prompt, max_tokens=1)
    other = complete(base, "globex", prompt=prompt, max_tokens=1)
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (again, other)]
    assert first.status_code == 200
    assert cached[0] > 0 and cached[1] == 0


def test_a_queued_request_past_its_deadline_gets_504_early(edge):
    base, _, omnid = edge
    instance = omnid.instances()["tiny"]["pid"]
    os.kill(instance, signal.SIGSTOP)  # the request holding the model's only permit cannot end
    try:
        holder = threading.Thread(target=complete, args=(base, "acme"))
        holder.start()
        wait_until(lambda: permits_in_use(base) >= 1, 30, "a request holding the permit")
        late = httpx.post(
            f"{base}/v1/completions",
            json={"model": "tiny", "prompt": "t1", "max_tokens": 1},
            headers={**auth("globex"), "x-omni-deadline-ms": "5"},
            timeout=15,
        )
        assert holder.is_alive()  # refused when due, not once the permit came free
    finally:
        os.kill(instance, signal.SIGCONT)
    holder.join()
    assert late.status_code == 504, late.text
    assert late.json()["error"]["code"] == "deadline_exceeded"
    bad = httpx.post(
        f"{base}/v1/completions",
        json={"model": "tiny", "prompt": "t1"},
        headers={**auth("globex"), "x-omni-deadline-ms": "soon"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-omni-deadline-ms"
