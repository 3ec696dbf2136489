"""Per-model environments (omni/runtime/envs.py): real pip over a real local wheelhouse."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from omni.isolation.sandbox import ProcessSandbox, SandboxSpec
from omni.runtime.envs import MANIFEST, EnvBuildError, environment, validate

from .wheels import sha256_of, write_sdist, write_wheel

SDIST_SETUP = """
import pathlib
pathlib.Path({marker!r}).write_text("setup.py ran")
raise SystemExit("setup.py ran")
"""


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    house = tmp_path_factory.mktemp("wheelhouse")
    write_wheel(house, "omni_testpkg", "1.0.0")
    # 2.0.0 needs a package of its own and numpy, which the shared base already has
    write_wheel(house, "omni_testpkg", "2.0.0", ("omni_testdep==1.0", "numpy>=1.0"))
    write_wheel(house, "omni_testdep", "1.0")
    write_wheel(house, "numpy", "0.0.1")  # a model that overrides a base package
    marker = house.parent / "setup-py-ran"
    write_sdist(house, "omni_sdistpkg", "1.0.0", SDIST_SETUP.format(marker=str(marker)))
    return house


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


def imported(env: Path, module: str = "omni_testpkg") -> str:
    """`module`'s VERSION and file as a fresh interpreter with `env` first on its path sees it."""
    code = f"import sys; sys.path.insert(0, {str(env)!r}); import {module} as m; "
    code += "print(m.VERSION, m.__file__)"
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_conflicting_versions_get_environments_of_their_own(wheelhouse, data_dir):
    one = environment(["omni_testpkg==1.0.0"], data_dir, wheelhouse)
    two = environment(["omni_testpkg==2.0.0"], data_dir, wheelhouse)
    assert one != two and one.parent == two.parent == data_dir / "envs"
    assert imported(one) == f"1.0.0 {one}/omni_testpkg/__init__.py"
    assert imported(two) == f"2.0.0 {two}/omni_testpkg/__init__.py"
    assert imported(two, "omni_testdep").startswith(f"1.0 {two}/")
    # numpy is the shared base's: resolved against it, not installed again
    assert not (two / "numpy").exists()
    manifest = json.loads((two / MANIFEST).read_text())
    assert [w[0] for w in manifest["wheels"]] == ["omni-testdep==1.0", "omni-testpkg==2.0.0"]


def test_environments_are_read_only_and_complete(wheelhouse, data_dir):
    env = environment(["omni_testpkg==1.0.0"], data_dir, wheelhouse)
    for dirpath, _, filenames in os.walk(env):
        assert stat.S_IMODE(os.stat(dirpath).st_mode) == 0o755, dirpath
        for name in filenames:
            path = Path(dirpath, name)
            assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
            assert path.stat().st_uid == os.geteuid()
    assert not list((data_dir / "envs").glob(".build-*"))


def test_a_second_call_reuses_the_environment_without_resolving(wheelhouse, tmp_path):
    house = tmp_path / "house"
    shutil.copytree(wheelhouse, house)
    first = environment(["omni_testpkg==1.0.0"], tmp_path / "data", house)
    inode = first.stat().st_ino
    for wheel in house.glob("*.whl"):  # were it resolved or built again, this would fail
        wheel.unlink()
    again = environment(["omni_testpkg==1.0.0"], tmp_path / "data", house)
    assert again == first and again.stat().st_ino == inode


def test_concurrent_builds_of_one_environment_make_one(wheelhouse, tmp_path):
    results: list[Path | BaseException] = []

    def build() -> None:
        try:
            results.append(environment(["omni_testpkg==2.0.0"], tmp_path, wheelhouse))
        except BaseException as exc:
            results.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and isinstance(results[0], Path), results
    envs = [p for p in (tmp_path / "envs").iterdir() if len(p.name) == 64]
    assert envs == [results[0]]
    assert not list((tmp_path / "envs").glob(".build-*"))


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("omni_testpkg", "pin an exact version"),
        ("omni_testpkg>=1.0", "pin an exact version"),
        ("omni_testpkg==1.*", "pin an exact version"),
        ("omni_testpkg==1.0.0,<2", "pin an exact version"),
        ("omni_testpkg @ file:///tmp/omni_testpkg-1.0.0-py3-none-any.whl", "exact version"),
        ("omni_testpkg==1.0.0 --hash=md5:0123", "--hash=sha256:"),
        ("omni testpkg==1.0.0", "not a requirement"),
    ],
)
def test_loose_or_odd_requirements_are_refused_before_anything_runs(entry, says, tmp_path):
    with pytest.raises(EnvBuildError) as err:
        environment(["omni_testdep==1.0", entry], tmp_path, tmp_path)
    assert f"requirements[1] {entry!r}" in str(err.value) and says in str(err.value)
    assert not (tmp_path / "envs").exists()


def test_a_build_past_its_time_is_stopped_with_the_reason(wheelhouse, tmp_path):
    with pytest.raises(EnvBuildError, match=r"took longer than the build's time|out of time"):
        environment(["omni_testpkg==1.0.0"], tmp_path, wheelhouse, timeout_s=0.05)
    envs = tmp_path / "envs"
    assert not envs.exists() or not [p for p in envs.iterdir() if len(p.name) == 64]


def test_a_package_listed_twice_is_refused():
    with pytest.raises(EnvBuildError, match=r"requirements\[1\].*listed twice"):
        validate(["omni_testpkg==1.0.0", "Omni-TestPkg==2.0.0"])


def test_a_package_without_a_wheel_is_refused_and_its_setup_never_runs(wheelhouse, data_dir):
    with pytest.raises(EnvBuildError) as err:
        environment(["omni_sdistpkg==1.0.0"], data_dir, wheelhouse)
    message = str(err.value)
    assert "omni_sdistpkg==1.0.0" in message and "sdists are never built" in message
    assert not (wheelhouse.parent / "setup-py-ran").exists()


def test_hashes_are_checked(wheelhouse, data_dir):
    good = sha256_of(wheelhouse / "omni_testpkg-1.0.0-py3-none-any.whl")
    env = environment([f"omni_testpkg==1.0.0 --hash={good}"], data_dir, wheelhouse)
    assert imported(env).startswith("1.0.0 ")
    wrong = "sha256:" + "0" * 64
    with pytest.raises(EnvBuildError, match="not a listed hash"):
        environment([f"omni_testpkg==1.0.0 --hash={wrong}"], data_dir, wheelhouse)


def test_a_model_may_override_a_base_package(wheelhouse, data_dir):
    env = environment(["numpy==0.0.1"], data_dir, wheelhouse)
    assert imported(env, "numpy") == f"0.0.1 {env}/numpy/__init__.py"


def test_a_conflict_with_the_base_names_the_packages(wheelhouse, tmp_path):
    write_wheel(tmp_path, "omni_oldnumpy_user", "1.0", ("numpy<0.1",))
    for wheel in wheelhouse.glob("omni_*.whl"):
        shutil.copy(wheel, tmp_path)
    with pytest.raises(EnvBuildError) as err:
        environment(["omni_oldnumpy_user==1.0"], tmp_path / "data", tmp_path)
    assert "omni_oldnumpy_user==1.0" in str(err.value)
    assert "numpy is in omnid's shared base" in str(err.value)


def test_a_plain_process_imports_from_its_environment(wheelhouse, data_dir, tmp_path):
    env = environment(["omni_testpkg==2.0.0"], data_dir, wheelhouse)
    log = tmp_path / "out.log"
    spec = SandboxSpec(
        name="env-proc",
        argv=[sys.executable, "-c", "import omni_testpkg; print(omni_testpkg.VERSION)"],
        env={"PATH": "/usr/bin:/bin"},
        model_dir=tmp_path,
        socket_dir=tmp_path / "io",
        log_path=log,
        python_env=env,
    )

    async def go():
        box = ProcessSandbox(spec)
        await box.start()
        return await asyncio.wait_for(box.wait(), 30)

    status = asyncio.run(go())
    assert status.returncode == 0, log.read_text()
    assert log.read_text().strip() == "2.0.0"


def test_a_no_deps_entry_is_installed_without_its_declared_dependencies(tmp_path):
    """For a package whose metadata pins more than it needs (facenet-pytorch pins an old
    torch): `--no-deps` installs it alone, its other entries resolve as usual."""
    house = tmp_path / "wheelhouse"
    house.mkdir()
    write_wheel(house, "omni_greedy", "1.0.0", ("omni_absent==9.9",))  # in no wheelhouse
    write_wheel(house, "omni_testpkg", "2.0.0", ("omni_testdep==1.0",))
    write_wheel(house, "omni_testdep", "1.0")
    with pytest.raises(EnvBuildError, match=r"omni[-_]absent"):
        environment(["omni_greedy==1.0.0"], tmp_path / "data", house)
    env = environment(
        ["omni_greedy==1.0.0 --no-deps", "omni_testpkg==2.0.0"], tmp_path / "data", house
    )
    assert imported(env, "omni_greedy") == f"1.0.0 {env}/omni_greedy/__init__.py"
    manifest = json.loads((env / MANIFEST).read_text())
    assert [w[0] for w in manifest["wheels"]] == [
        "omni-greedy==1.0.0",
        "omni-testdep==1.0",
        "omni-testpkg==2.0.0",
    ]
    assert [p.deps for p in validate(["a==1 --no-deps", "b==2"])] == [False, True]
