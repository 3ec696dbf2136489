"""A model's own environment in a real isolated sandbox: its own, read-only, at a fixed
path, on its import path; no other model's environment and not the directory of them."""

from __future__ import annotations

from pathlib import Path

import omni
from omni.isolation.sandbox import PYTHON_ENV_MOUNT
from omni.runtime.envs import environment, shared_base_entries

from ..wheels import write_wheel
from .test_escape import run

CHECKOUT = Path(omni.__file__).resolve().parents[1]


def test_a_sandbox_sees_its_own_environment_alone(host):
    house = host.root / "wheelhouse"
    house.mkdir()
    write_wheel(house, "omni_testpkg", "1.0.0")
    write_wheel(house, "omni_testpkg", "2.0.0")
    # under a path the sandbox shows (extra_ro): the other environments must still be hidden
    data_dir = host.shared / "omni-data"
    mine = environment(["omni_testpkg==1.0.0"], data_dir, house)
    other = environment(["omni_testpkg==2.0.0"], data_dir, house)
    r = run(
        host,
        f"""
import sys, omni_testpkg
report(version=omni_testpkg.VERSION, file=omni_testpkg.__file__,
       on_path={str(PYTHON_ENV_MOUNT)!r} in sys.path,
       write=attempt(lambda: open({str(PYTHON_ENV_MOUNT / "planted.py")!r}, "w")),
       envs=os.listdir({str(mine.parent)!r}),
       other=attempt(lambda: open({str(other / "omni_testpkg" / "__init__.py")!r}).read()),
       mine_by_host_path=attempt(lambda: os.listdir({str(mine)!r})))
""",
        python_env=mine,
    )
    assert r["version"] == "1.0.0"
    assert r["file"] == f"{PYTHON_ENV_MOUNT}/omni_testpkg/__init__.py"
    assert r["on_path"] is True
    assert r["write"] == "EROFS"
    assert r["envs"] == []  # the directory of environments: covered, empty
    assert r["other"] == "ENOENT" and r["mine_by_host_path"] == "ENOENT"


def test_a_handler_sees_the_shared_base_alone_of_omnids_packages(host):
    base = shared_base_entries()
    site_dir = next(e.parent for e in base if e.name.startswith("numpy-"))
    hidden = sorted(p.name for p in site_dir.iterdir() if p not in base)
    assert "transformers" in hidden  # (dev installs): a package the base does not hold
    r = run(
        host,
        f"""
import importlib
def load(name):
    try:
        importlib.import_module(name)
        return "ok"
    except ImportError as exc:
        return type(exc).__name__
report(loads={{n: load(n) for n in ("numpy", "aiohttp", "torch", "omni.isolation.sandbox",
                                     "transformers", "grpc", "xgrammar")}},
       listing=sorted(os.listdir({str(site_dir)!r})))
""",
        python_base=base,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(CHECKOUT)},  # as omnid's InstanceCode
    )
    assert r["loads"] == {
        "numpy": "ok",
        "aiohttp": "ok",
        "torch": "ok",
        "omni.isolation.sandbox": "ok",
        "transformers": "ModuleNotFoundError",
        "grpc": "ModuleNotFoundError",
        "xgrammar": "ModuleNotFoundError",
    }
    assert set(r["listing"]) <= {p.name for p in base} | {"omni"}


def test_the_python_worker_needs_nothing_beyond_the_shared_base(host):
    """SHARED_BASE holds what the worker around a handler imports: were it to import a
    package outside it, an isolated python-runtime instance could not start."""
    r = run(
        host,
        """
import importlib
for name in ("omni.instance.worker", "omni.instance.python_backend"):
    importlib.import_module(name)
report(ok=True)
""",
        python_base=shared_base_entries(),
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(CHECKOUT)},
    )
    assert r == {"ok": True}
