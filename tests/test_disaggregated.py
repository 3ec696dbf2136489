"""A model served disaggregated by omnid: a prefill instance and a decode instance, each in
its own sandbox, hand the prompt's K/V over (omni/runtime/disaggregated.py), and the
answers are one instance's answers."""

from __future__ import annotations

import httpx
import openai
import pytest

from omni.runtime.catalog import CatalogError, load_config
from omni.testing.checkpoints import tiny_llama
from tests.nodes import Omnid

PROMPT = " ".join(f"t{i % 90}" for i in range(1, 60))  # 59 tokens: three blocks to move


def config(path, state) -> str:
    return (  # ("one" keeps a disk KV tier: its directory is bound writable in its sandbox)
        f'state_dir = "{state}"\n'
        f'[[models]]\nname = "one"\npath = "{path}"\n'
        'kv_host_cache = "16KiB"\nkv_disk_cache = "1MiB"\n'
        f'[[models]]\nname = "m-prefill"\npath = "{path}"\nrole = "prefill"\nserves = "m"\n'
        f'[[models]]\nname = "m-decode"\npath = "{path}"\nrole = "decode"\nserves = "m"\n'
    )


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    # sandboxed (isolated, as root)
    node = Omnid(tmp, config(tiny_llama(tmp / "model"), tmp / "state"))
    try:
        node.wait_ready(["one", "m-prefill", "m-decode"])
        yield node
    finally:
        assert node.stop() == 0


def test_prefill_and_decode_instances_answer_as_one_instance(node):
    client = openai.OpenAI(base_url=f"{node.base_url}/v1", api_key="-")
    for model in ("one", "m"):
        assert model in [m.id for m in client.models.list()]
    args = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    one = client.completions.create(model="one", **args)
    pd = client.completions.create(model="m", **args)
    assert pd.choices[0].text == one.choices[0].text and len(pd.choices[0].text.split()) == 12
    assert pd.usage.prompt_tokens == one.usage.prompt_tokens == 59
    seeded = {**args, "temperature": 1.0, "seed": 5}
    streamed = client.completions.create(model="m", stream=True, **seeded)
    text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    assert text == client.completions.create(model="one", **seeded).choices[0].text
    metrics = httpx.get(f"{node.base_url}/metrics").text
    moved = [
        m for m in metrics.splitlines() if m.startswith('omni_kv_transfer_bytes_total{model="m"}')
    ]
    assert moved and float(moved[0].split()[-1]) > 0, moved
    # nothing is left behind in the instances' directories
    assert not list(node.runtime_dir.rglob("kv-*"))
    disk = (
        node.log_path.parent / "state" / "kv-disk" / "one"
    )  # the instance's own, and nobody else's
    assert disk.is_dir() and disk.stat().st_uid != 0 and disk.stat().st_mode & 0o777 == 0o700


def test_the_model_list_shows_the_served_name_and_its_load(node):
    data = {m["id"]: m for m in httpx.get(f"{node.base_url}/v1/models").json()["data"]}
    assert set(data) == {"one", "m"}  # the sides are instances, not models to call
    assert data["m"]["disaggregated"] == {"prefill": ["m-prefill"], "decode": ["m-decode"]}
    for entry in data.values():
        assert set(entry["load"]) == {"queued_prompt_tokens", "kv_occupancy"}


def test_a_client_cannot_name_a_handoff_and_bad_input_stays_a_400(node):
    body = {"model": "one", "prompt": PROMPT, "max_tokens": 2}
    for header in ("x-omni-kv-import", "x-omni-kv-export"):
        r = httpx.post(
            f"{node.base_url}/v1/completions", json=body, headers={header: "0" * 32}, timeout=60
        )
        assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
    too_long = {"model": "m", "prompt": PROMPT, "max_tokens": 1000}
    r = httpx.post(f"{node.base_url}/v1/completions", json=too_long, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_a_served_name_missing_a_side_is_a_503_with_retry_after(node):
    with node.admin() as c:  # (the last test here: it unloads the decode side)
        assert c.delete("/v1/models/m-decode").status_code == 200
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 2}
    r = httpx.post(f"{node.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 503 and "no decode instance" in r.json()["error"]["message"]
    assert r.headers["Retry-After"] == "5"


def test_a_disaggregated_model_needs_both_sides_of_one_checkpoint(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
    path = tmp_path / "omnid.toml"
    side = '[[models]]\nname = "{n}"\npath = "{p}"\nrole = "{r}"\nserves = "m"\n'
    for text, message in (
        (side.format(n="x", p=a, r="prefill"), r"needs a prefill and a decode entry"),
        (
            side.format(n="x", p=a, r="prefill") + side.format(n="y", p=b, r="decode"),
            "share one checkpoint",
        ),
        (
            side.format(n="x", p=a, r="prefill")
            + side.format(n="y", p=a, r="decode")
            + f'[[models]]\nname = "m"\npath = "{a}"\n',
            "is an entry too",
        ),
        (f'[[models]]\nname = "x"\npath = "{a}"\nrole = "both"\nserves = "m"\n', "role: one of"),
        (f'[[models]]\nname = "x"\npath = "{a}"\nrole = "decode"\n', "serves: the model name"),
    ):
        path.write_text(text)
        with pytest.raises(CatalogError, match=message):
            load_config(path)
