"""The code an instance runs: omnid's own interpreter and `omni` package, at their real paths.

An instance must run exactly what omnid runs. Left to itself it would not: a venv
reached through a symlink is shown in the sandbox at its real path only, and a worker
started with `-m` resolves `omni` through whatever is installed (an editable finder
pointing at another checkout, a non-editable copy) rather than the checkout omnid
imported from its working directory. So omnid resolves both once and hands them over:
the interpreter by its real directory, `-P` (no working directory on sys.path), and a
PYTHONPATH that puts omnid's own `omni` first; the worker checks it got that package.
"""

from __future__ import annotations

import functools
import os
import site
import sys
from dataclasses import dataclass
from pathlib import Path

import omni

PACKAGE_ENV = "OMNI_PACKAGE"  # the package directory the worker must have imported


@dataclass(frozen=True)
class InstanceCode:
    python: str  # omnid's interpreter: its directory resolved, its own name kept
    package: Path  # the `omni` package omnid imported, resolved
    pythonpath: str  # the instance's PYTHONPATH ("" where none is needed)

    @classmethod
    @functools.cache
    def of_this_process(cls) -> InstanceCode:
        exe = sys.executable
        # Only the directory: a venv's bin/python is itself a link to the base interpreter,
        # and the venv is found from the name it was started by.
        python = os.path.join(os.path.realpath(os.path.dirname(exe)), os.path.basename(exe))
        package = Path(omni.__file__).resolve().parent
        sites = {Path(p).resolve() for p in site.getsitepackages()}
        entries = [] if package.parent in sites else [str(package.parent)]
        for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
            if entry and os.path.isabs(entry):  # relative ones name omnid's working dir
                real = os.path.realpath(entry)
                if real not in entries:
                    entries.append(real)
        return cls(python, package, os.pathsep.join(entries))

    def argv(self, module: str, *args: str) -> list[str]:
        return [self.python, "-P", "-m", module, *args]

    def env(self) -> dict[str, str]:
        env = {PACKAGE_ENV: str(self.package)}
        if self.pythonpath:
            env["PYTHONPATH"] = self.pythonpath
        return env

    def describe(self) -> str:
        where = f", PYTHONPATH {self.pythonpath}" if self.pythonpath else ""
        return f"{self.python} with omni from {self.package}{where}"


def check_package(expected: str | None) -> None:
    """In the worker: refuse to serve with another `omni` than omnid's."""
    actual = Path(omni.__file__).resolve().parent
    if expected and Path(expected) != actual:
        raise SystemExit(f"this instance imported omni from {actual}, but omnid runs {expected}")
