"""A model's own Python packages: one read-only environment per resolved set, built once.

A `runtime = "python"` model lists `requirements`, each exactly pinned (`name==1.2.3`,
optionally followed by pip's `--hash=sha256:...`, and by `--no-deps` for a package whose
metadata pins more than it needs: it is installed without its declared dependencies,
and the model lists those it does need). `environment()` resolves them with
pip, wheels only (`--only-binary :all:`: no setup.py or build backend ever runs), and
installs what they need into `<data_dir>/envs/<id>`, where `<id>` is the sha256 of the
resolved wheels (name, version, file hash), the interpreter's version and its platform.
So two models that resolve alike share one environment, and two that pin different
versions of a package get two, side by side. With a `wheelhouse` nothing is fetched
(`--no-index --find-links`); without one pip uses its index (and its own config).

The shared base. An instance runs omnid's interpreter, whose site-packages hold
`SHARED_BASE` and everything those need (their closure: torch brings sympy, networkx,
jinja2...; aiohttp brings yarl, multidict...). Those are never installed again: the
resolver is shown them as already installed (and nothing else of omnid's venv), so an
environment holds the model's packages plus the dependencies the base does not satisfy,
at versions compatible with the base. A model that must have another version of a base
package pins it in its own requirements: then it is resolved like any other package,
installed into the environment, and shadows the base's copy (the environment comes
before site-packages on the instance's path); the rest of the base stays as it is, so
the pin must suit it (another numpy under omnid's torch is the model's own risk).

Builds run under a per-environment lock, in a temporary directory that is fsynced,
made read-only for everyone but its owner (0755 directories, 0644 files) and renamed
into place, so a present environment is always complete. A request seen before (same
requirements, base, interpreter and source) finds its environment without resolving
again. Call it off the event loop (`asyncio.to_thread`): a first build takes seconds.

In the sandbox (omni/isolation): `SandboxSpec.python_env` binds the environment read-only
at /omni/env (the process sandbox: its host path) and puts it on the instance's
PYTHONPATH; `SandboxSpec.python_base = shared_base_entries()` narrows the view of
site-packages to the shared base, so a handler cannot import the rest of omnid's venv.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

# What every python-runtime instance imports from omnid's venv: the handler contract's
# arrays and the worker around it (its HTTP server, JSON, request schemas), and torch.
SHARED_BASE = ("numpy", "torch", "aiohttp", "orjson", "pydantic")
BUILD_TIMEOUT_S = 600.0
MANIFEST = "omni-env.json"  # in each environment: what it holds and for which interpreter
HASH = re.compile(r"sha256:[0-9a-f]{64}")
ENV_ID = re.compile(r"[0-9a-f]{64}")

# Run in the target interpreter: its version and platform, pip's location, the shared
# base's closure as {name: [version, dist-info directory]}, and the top-level entries of
# site-packages those distributions own (packages, modules, .libs, dist-info).
_PROBE = """
import importlib.metadata as md, json, os, sys, sysconfig
import pip
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name
base, todo, entries = {}, [canonicalize_name(n) for n in json.loads(sys.argv[1])], set()
while todo:
    name = todo.pop()
    if name in base:
        continue
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    base[name] = [dist.version, str(dist._path)]
    for file in dist.files or ():
        if file.parts and file.parts[0] != ".." and not file.parts[0].endswith(".pth"):
            where = os.path.normpath(dist.locate_file(file.parts[0]))  # real directory:
            real = os.path.join(os.path.realpath(os.path.dirname(where)), file.parts[0])
            entries.add(real)  # a venv reached through a link is shown at its real path
    for line in dist.requires or ():
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            todo.append(canonicalize_name(req.name))
for entry in [e for e in entries if e.endswith(".py")]:  # a module's compiled bytecode
    entries.add(os.path.join(os.path.dirname(entry), "__pycache__"))
print(json.dumps({
    "python": sys.implementation.cache_tag + "-" + ".".join(map(str, sys.version_info[:3])),
    "platform": sysconfig.get_platform(),
    "pip": os.path.dirname(pip.__file__),
    "base": base,
    "entries": sorted(e for e in entries if os.path.exists(e)),
}))
"""
# pip run with only the shared base's metadata on its path: it takes that as installed.
_PIP_OVER_BASE = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); "
    "from pip._internal.cli.main import main; sys.exit(main())"
)


class EnvBuildError(Exception):
    """A model's environment could not be made; the message says which entry and why."""


@dataclass(frozen=True)
class Pin:
    """One validated requirement: `name==version`, and the wheel hashes it accepts."""

    name: str  # canonical
    line: str  # as pip reads it, without hashes
    hashes: tuple[str, ...] = ()  # "sha256:<hex>"
    deps: bool = True  # False: `--no-deps`, installed without its declared dependencies


@dataclass(frozen=True)
class Interpreter:
    """What an environment is built for, and the base it must not repeat."""

    python: Path
    tag: str  # cache tag and version: cpython-311-3.11.7
    platform: str
    pip: Path  # pip's package directory
    base: dict[str, tuple[str, str]]  # canonical name: (version, dist-info directory)
    base_entries: tuple[Path, ...] = ()  # what the base's distributions put in site-packages


def environment(
    requirements: list[str],
    data_dir: Path,
    wheelhouse: Path | None = None,
    python: Path = Path(sys.executable),
    timeout_s: float = BUILD_TIMEOUT_S,
) -> Path:
    """The directory holding `requirements` for `python` (what goes on the instance's
    import path), built if missing.

    Raises EnvBuildError (bad entry, no wheel, conflict, timeout) with the reason a
    model's start failure should show.
    """
    deadline = time.monotonic() + timeout_s
    pins = validate(requirements)
    interp = probe(python, deadline)
    root = Path(data_dir) / "envs"
    for sub in (root, root / "requests", root / "locks"):
        sub.mkdir(mode=0o755, parents=True, exist_ok=True)
    request = root / "requests" / request_key(pins, interp, wheelhouse)
    known = _known(root, request)
    if known is not None:
        return known
    with tempfile.TemporaryDirectory(prefix="resolve-", dir=root) as scratch:
        wheels = resolve(pins, interp, wheelhouse, Path(scratch), deadline)
    env_id = environment_id(wheels, interp)
    target = root / env_id
    with _locked(root / "locks" / f"{env_id}.lock"):
        if not target.is_dir():
            build(target, wheels, interp, wheelhouse, root, deadline)
        _write_atomically(request, env_id)
    return target


def validate(requirements: list[str]) -> list[Pin]:
    """Each entry exactly pinned, by name, from an index or wheelhouse (never a URL or path)."""
    pins: list[Pin] = []
    for i, entry in enumerate(requirements):
        where = f"requirements[{i}] {entry!r}"
        if not isinstance(entry, str):
            raise EnvBuildError(f"{where}: not a string")
        entry, no_deps = re.subn(r"\s+--no-deps\b", "", entry.strip())
        head, *hashes = re.split(r"\s+--hash[=\s]\s*", entry)
        try:
            req = Requirement(head)
        except InvalidRequirement as exc:
            raise EnvBuildError(f"{where}: not a requirement ({exc})") from None
        if not _exactly_pinned(req):
            raise EnvBuildError(f"{where}: pin an exact version, as name==1.2.3")
        bad = [h for h in hashes if not HASH.fullmatch(h)]
        if bad:
            raise EnvBuildError(f"{where}: hashes are --hash=sha256:<64 hex digits>, not {bad[0]}")
        name = canonicalize_name(req.name)
        if any(p.name == name for p in pins):
            raise EnvBuildError(f"{where}: {req.name} is listed twice")
        pins.append(Pin(name, str(req), tuple(hashes), deps=not no_deps))
    return pins


def _exactly_pinned(req: Requirement) -> bool:
    """One version and no other (not a range, a wildcard, a URL or a local path)."""
    specs = list(req.specifier)
    if req.url or len(specs) != 1:
        return False
    return specs[0].operator in ("==", "===") and not specs[0].version.endswith("*")


def probe(python: Path, deadline: float) -> Interpreter:
    """The interpreter's version, platform, pip and shared base (asked of it: it may
    not be the one running omnid)."""
    out = _run(
        [str(python), "-I", "-c", _PROBE, json.dumps(SHARED_BASE)],
        "inspecting the interpreter",
        deadline,
    )
    info = json.loads(out)
    base = {name: (version, path) for name, (version, path) in info["base"].items()}
    entries = tuple(map(Path, info["entries"]))
    return Interpreter(
        Path(python), info["python"], info["platform"], Path(info["pip"]), base, entries
    )


@functools.cache
@functools.cache
def shared_base_entries(python: Path = Path(sys.executable)) -> tuple[Path, ...]:
    """The shared base's files in site-packages: all of site-packages an isolated
    python-runtime instance needs to see (SandboxSpec.python_base)."""
    return probe(python, time.monotonic() + 60).base_entries


def request_key(pins: list[Pin], interp: Interpreter, wheelhouse: Path | None) -> str:
    """What decides a resolution: the pins, the base, the interpreter and the source."""
    return _digest(
        {
            "pins": sorted([p.line, *p.hashes, *([] if p.deps else ["--no-deps"])] for p in pins),
            "base": sorted((n, v) for n, (v, _) in interp.base.items()),
            "python": interp.tag,
            "platform": interp.platform,
            "source": str(Path(wheelhouse).resolve()) if wheelhouse else "index",
        }
    )


def resolve(
    pins: list[Pin], interp: Interpreter, wheelhouse: Path | None, scratch: Path, deadline: float
) -> list[Pin]:
    """The wheels to install: the model's pins and their dependencies that the shared base
    does not satisfy, each as name==version with its file's sha256 (a dry run: nothing
    is installed and, wheels only, nothing runs)."""
    if not pins:
        return []
    overridden = {p.name for p in pins}
    view = scratch / "base"
    view.mkdir()
    os.symlink(interp.pip, view / "pip")  # pip itself, not its metadata: not "installed"
    for name, (_, dist_info) in interp.base.items():
        if name not in overridden:  # a pinned base package is resolved afresh
            os.symlink(dist_info, view / Path(dist_info).name)
    items = []
    for deps in (True, False):  # with their dependencies, then the --no-deps ones alone
        group = [p for p in pins if p.deps == deps]
        if group:
            items += _dry_run(group, deps, interp, view, wheelhouse, scratch, deadline)
    wanted = {p.name: p for p in pins}
    wheels: dict[str, Pin] = {}
    for item in items:
        name = canonicalize_name(item["metadata"]["name"])
        hashes = item.get("download_info", {}).get("archive_info", {}).get("hashes", {})
        if "sha256" not in hashes:
            raise EnvBuildError(f"resolving: pip named no sha256 for {name}'s wheel")
        digest = "sha256:" + hashes["sha256"]
        pin = wanted.get(name)
        if pin is not None and pin.hashes and digest not in pin.hashes:
            raise EnvBuildError(f"{pin.line}: the wheel found has {digest}, not a listed hash")
        wheel = Pin(name, f"{name}=={item['metadata']['version']}", (digest,))
        if wheels.setdefault(name, wheel) != wheel:
            raise EnvBuildError(f"resolving: {wheels[name].line} and {wheel.line} both needed")
    return sorted(wheels.values(), key=lambda w: w.name)


def _dry_run(
    pins: list[Pin],
    deps: bool,
    interp: Interpreter,
    view: Path,
    wheelhouse: Path | None,
    scratch: Path,
    deadline: float,
) -> list[dict]:
    """pip's report of what it would install for `pins` over the shared base."""
    suffix = "" if deps else "-no-deps"
    reqs, report = scratch / f"requirements{suffix}.txt", scratch / f"report{suffix}.json"
    reqs.write_text("".join(f"{p.line}\n" for p in pins))
    argv = [str(interp.python), "-I", "-S", "-c", _PIP_OVER_BASE, str(view), "install"]
    argv += ["--dry-run", "--report", str(report), "-r", str(reqs)]
    argv += [] if deps else ["--no-deps"]
    cache = scratch.parent / "pip-cache"
    try:
        _run(argv + _pip_options(wheelhouse, cache), "resolving", deadline, pins)
    except EnvBuildError as exc:
        raise EnvBuildError(f"{exc}{_unfound_hint(str(exc), interp)}") from None
    return json.loads(report.read_text())["install"]


def environment_id(wheels: list[Pin], interp: Interpreter) -> str:
    """The content address: the exact wheels, for this interpreter version and platform."""
    return _digest(
        {
            "wheels": [[w.line, *w.hashes] for w in wheels],
            "python": interp.tag,
            "platform": interp.platform,
        }
    )


def build(
    target: Path,
    wheels: list[Pin],
    interp: Interpreter,
    wheelhouse: Path | None,
    root: Path,
    deadline: float,
) -> None:
    """Install exactly `wheels` (hash-checked, no dependency resolution) beside `target`,
    then make it read-only, durable, and move it into place in one rename."""
    for stale in root.glob(f".build-{target.name}-*"):  # a build killed mid-way
        shutil.rmtree(stale, ignore_errors=True)
    staging = root / f".build-{target.name}-{secrets.token_hex(4)}"
    staging.mkdir(mode=0o755)
    try:
        if wheels:
            reqs = root / f"{staging.name}.txt"
            reqs.write_text("".join(f"{w.line} --hash={w.hashes[0]}\n" for w in wheels))
            try:
                argv = [str(interp.python), "-I", "-m", "pip", "install", "--target"]
                argv += [str(staging), "--no-deps", "--require-hashes", "-r", str(reqs)]
                cache = root / "pip-cache"
                _run(argv + _pip_options(wheelhouse, cache), "installing", deadline, wheels)
            finally:
                reqs.unlink(missing_ok=True)
        manifest = {
            "wheels": [[w.line, *w.hashes] for w in wheels],
            "python": interp.tag,
            "platform": interp.platform,
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        seal(staging)
        os.rename(staging, target)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def seal(tree: Path) -> None:
    """Directories 0755 and files 0644, no links out of the tree, everything on disk."""
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in filenames + dirnames:
            path = Path(dirpath, name)
            if path.is_symlink():
                real = path.resolve()
                if real != tree.resolve() and tree.resolve() not in real.parents:
                    raise EnvBuildError(f"{path.relative_to(tree)} links outside the environment")
                continue
            if name in filenames:
                path.chmod(0o644)
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        os.chmod(dirpath, 0o755)
        _fsync_dir(Path(dirpath))


def _pip_options(wheelhouse: Path | None, cache: Path) -> list[str]:
    options = ["--only-binary", ":all:", "--disable-pip-version-check", "--no-input"]
    options += ["--no-warn-script-location", "--cache-dir", str(cache)]
    if wheelhouse is not None:
        options += ["--no-index", "--find-links", str(Path(wheelhouse).resolve())]
    return options


def _run(argv: list[str], step: str, deadline: float, pins: Sequence[Pin] = ()) -> str:
    """pip (or the probe) within what is left of the build's time; its errors, readable."""
    left = deadline - time.monotonic()
    what = ", ".join(p.line for p in pins) or str(argv[0])
    if left <= 0:
        raise EnvBuildError(f"{step} {what}: out of time")
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=left, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise EnvBuildError(f"{step} {what}: took longer than the build's time") from None
    except OSError as exc:
        raise EnvBuildError(f"{step} {what}: {exc}") from None
    if done.returncode != 0:
        raise EnvBuildError(f"{step} {what} failed: {_explain(done.stderr or done.stdout)}")
    return done.stdout


def _explain(output: str) -> str:
    errors = [line.strip() for line in output.splitlines() if line.startswith("ERROR")]
    return " ".join(errors[:4]) or " ".join(output.strip().splitlines()[-3:])


def _unfound_hint(message: str, interp: Interpreter) -> str:
    """Why pip found nothing: a base package held at the base's version, or no wheel."""
    unfound = re.search(r"satisfies the requirement (.+?) \(from", message)
    if unfound is None:
        return ""
    try:
        name = canonicalize_name(Requirement(unfound.group(1)).name)
    except InvalidRequirement:
        return ""
    if name in interp.base:
        version = interp.base[name][0]
        return (
            f" ({name} is in omnid's shared base, at {version}; a model that needs another"
            f" version pins {name} in its own requirements)"
        )
    return " (no wheel of it for this interpreter and platform: sdists are never built)"


def _known(root: Path, request: Path) -> Path | None:
    """The complete environment an earlier identical request was given, if still there."""
    with contextlib.suppress(OSError):
        env_id = request.read_text().strip()
        env = root / env_id
        if ENV_ID.fullmatch(env_id) and env.is_dir() and (env / MANIFEST).is_file():
            return env
    return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    os.rename(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()
