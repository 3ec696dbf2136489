"""The README's examples run as written against a live `omni serve`, so they stay true.

Every ```sh and ```python block runs, in the README's order, against one server with the
default models; ```toml blocks must load as omnid's config. Blocks meant to be read, not
run (`make serve` itself), are fenced ```console. Two things differ from a user's
machine and are rewritten: the edge's port (the test's server has a free one) and the
data directory (the tests share one converted copy of the default models).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from omni.runtime.catalog import load_config

from .conftest import DATA_DIR, DEFAULT_MODELS, PACKAGED_MODELS, REPO, running_server

README = REPO / "README.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks(lang: str) -> list[str]:
    return [body for kind, body in BLOCK.findall(README.read_text()) if kind == lang]


def runnable() -> list[tuple[str, str]]:
    return [(k, b) for k, b in BLOCK.findall(README.read_text()) if k in ("sh", "python")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ready = (*DEFAULT_MODELS, *PACKAGED_MODELS)
    with running_server(tmp_path_factory.mktemp("readme"), ready=ready) as srv:
        yield srv


def as_here(text: str, server) -> str:
    text = text.replace("127.0.0.1:8080", f"127.0.0.1:{server.port}")
    return text.replace("/var/lib/omni", str(DATA_DIR))


def test_the_readme_is_a_guide_not_a_notebook():
    text = README.read_text()
    assert len(text.splitlines()) < 300
    hashes = re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", text)
    assert not hashes, f"commit hashes in the README: {hashes}"
    for target, anchor in re.findall(r"\]\(([^)#]+)(?:#([^)]*))?\)", text):
        if target.startswith("http"):
            continue
        assert (REPO / target).exists(), f"the README links to a missing {target}"
        if anchor:
            assert anchor in anchors(REPO / target), f"no section #{anchor} in {target}"


def anchors(page: Path) -> set[str]:
    """The ids GitHub gives a Markdown page's headings."""
    titles = re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", t.strip().lower()).replace(" ", "-") for t in titles}


@pytest.mark.parametrize("body", blocks("toml"))
def test_its_config_examples_load(tmp_path, body):
    path = tmp_path / "omnid.toml"
    path.write_text(body)
    load_config(path)  # raises CatalogError naming the key otherwise


@pytest.mark.parametrize(
    "kind,body", runnable(), ids=[f"{i}-{kind}" for i, (kind, _) in enumerate(runnable())]
)
def test_its_examples_run_as_written(server, kind, body):
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # omnictl, python
        "OMNI_RUNTIME_DIR": str(server.runtime_dir),
    }
    argv = ["bash", "-euo", "pipefail", "-c"] if kind == "sh" else [sys.executable, "-c"]
    done = subprocess.run(
        [*argv, as_here(body, server)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{body}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert done.stdout.strip(), f"no output from:\n{body}"
    assert '"error"' not in done.stdout, f"{body}\n--- answered\n{done.stdout}"
    if "What is the capital of France?" in body:  # the README says what it answers
        assert "Paris" in done.stdout, done.stdout
    if "transcriptions.create" in body:  # the sentence it speaks is heard
        assert "the weather is nice today" in done.stdout, done.stdout
    if "/v1/run/langid" in body:
        assert '"label":"fr"' in done.stdout, done.stdout
