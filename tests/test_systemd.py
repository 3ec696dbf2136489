"""The systemd units and sd_notify: units that systemd accepts, and omnid saying READY,
WATCHDOG and STOPPING through the socket systemd would give it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni import sdnotify

from .conftest import REPO, free_port

SYSTEMD_DIR = REPO / "systemd"
UNITS = ("omnid.service", "omni-edge.service", "omni-scheduler.service")
INSTALLED_BIN = "/usr/local/bin/"
VENV_BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(
            f"{name} not found: `make test` installs Debian's systemd (needs root, network)"
        )
    return path


def _unit(name: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (systemd keys may repeat, so no configparser)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for line in (SYSTEMD_DIR / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
        else:
            key, _, value = line.partition("=")
            current.setdefault(key.strip(), []).append(value.strip())
    return sections


# --- the units -------------------------------------------------------------------------------


def test_systemd_analyze_verify(tmp_path):
    """systemd-analyze verify accepts all three units with no warning about them.

    It insists that ExecStart= binaries exist, so the copies it checks point at this
    venv's console scripts instead of /usr/local/bin. A User= that does not exist is not
    its concern (systemd resolves it at start), so omni need not exist here. It reports
    most mistakes (unknown key, unparsable value) as a warning with exit status 0: any
    output line about our units fails the test.
    """
    analyze = _tool("systemd-analyze")
    for name in UNITS:
        text = (SYSTEMD_DIR / name).read_text()
        assert INSTALLED_BIN in text, f"{name}: ExecStart= should run {INSTALLED_BIN}..."
        (tmp_path / name).write_text(text.replace(INSTALLED_BIN, f"{VENV_BIN}/"))
        for binary in re.findall(rf"{INSTALLED_BIN}(\S+)", text):
            assert (VENV_BIN / binary).exists(), (
                f"{VENV_BIN / binary} missing: `pip install -e .` (make setup) installs it"
            )
    proc = subprocess.run(
        [analyze, "verify", *(str(tmp_path / n) for n in UNITS)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    output = proc.stdout + proc.stderr
    print(output)
    # Other lines, if any, are about the host's own units (verify loads their dependencies).
    ours = [
        line
        for line in output.splitlines()
        if str(tmp_path) in line or any(n.removesuffix(".service") in line for n in UNITS)
    ]
    assert proc.returncode == 0, output
    assert not ours, "\n".join(ours)


def test_units_as_specified():
    """What verify cannot know: the settings omnid depends on, and users where intended."""
    omnid = _unit("omnid.service")["Service"]
    for key, value in {
        "Type": "notify",
        "NotifyAccess": "main",
        "WatchdogSec": "30",
        "Delegate": "yes",
        "KillMode": "process",  # its instances outlive it (live restore)
        "RuntimeDirectoryPreserve": "yes",
        "RuntimeDirectory": "omni",
        "StateDirectory": "omni",
        "Restart": "on-failure",
        "OOMPolicy": "continue",
        "ExecStart": "/usr/local/bin/omnid --config /etc/omni/omnid.toml --live-restore",
    }.items():
        assert omnid.get(key) == [value], f"omnid.service: {key}={omnid.get(key)}"
    assert "User" not in omnid, "omnid runs as root: it creates cgroups and namespaces"
    assert "StartLimitBurst" in _unit("omnid.service")["Unit"]

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for name in UNITS:
        service = _unit(name)["Service"]
        binary = service["ExecStart"][0].split()[0].removeprefix(INSTALLED_BIN)
        assert binary in scripts, f"{name}: {binary} is not a [project.scripts] entry"
        if name != "omnid.service":
            assert service["User"] == ["omni"], name
            for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
                assert service[key] == ["yes"], f"{name}: {key}"
            assert service["ProtectSystem"] == ["strict"], name


def test_sysusers_snippet(tmp_path):
    """systemd-sysusers creates the omni system user and group from the snippet."""
    sysusers = _tool("systemd-sysusers")
    (tmp_path / "etc").mkdir()
    proc = subprocess.run(
        [sysusers, f"--root={tmp_path}", str(SYSTEMD_DIR / "omni.sysusers.conf")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    passwd = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "etc" / "passwd").read_text().splitlines()
    }
    groups = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "etc" / "group").read_text().splitlines()
    }
    assert "omni" in passwd and "omni" in groups, proc.stderr
    uid, gid = int(passwd["omni"][2]), int(passwd["omni"][3])
    assert 0 < uid < 1000, f"omni should be a system user, got uid {uid}"
    assert gid == int(groups["omni"][2])
    assert passwd["omni"][6].endswith("nologin")


def test_tmpfiles_snippet(tmp_path):
    """systemd-tmpfiles accepts the snippet and lays out /etc/omni and /var/lib/omni."""
    tmpfiles = _tool("systemd-tmpfiles")
    proc = subprocess.run(
        [tmpfiles, f"--root={tmp_path}", "--create", str(SYSTEMD_DIR / "omni.tmpfiles.conf")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    assert (tmp_path / "etc/omni").is_dir()
    config = tmp_path / "etc/omni/omnid.toml"
    assert config.is_file() and tomllib.loads(config.read_text()) == {}
    state = tmp_path / "var/lib/omni"
    # The same mode as omnid.service's StateDirectoryMode=, or each would undo the other.
    unit_mode = int(_unit("omnid.service")["Service"]["StateDirectoryMode"][0], 8)
    assert state.stat().st_mode & 0o7777 == unit_mode


# --- sd_notify -----------------------------------------------------------------------------


@contextlib.contextmanager
def listening(abstract: bool = False) -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket as systemd's notify socket is, and the $NOTIFY_SOCKET naming it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    tmp = None
    try:
        if abstract:
            name = f"omni-test-{uuid.uuid4().hex}"
            sock.bind(b"\0" + name.encode())
            address = "@" + name
        else:
            # pytest's tmp_path can exceed the 107-byte limit on socket paths.
            tmp = tempfile.mkdtemp(prefix="omni-")
            address = os.path.join(tmp, "notify")
            sock.bind(address)
        sock.settimeout(5)
        yield sock, address
    finally:
        sock.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def drain(sock: socket.socket) -> list[bytes]:
    out = []
    sock.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:
            out.append(sock.recv(4096))
    sock.settimeout(5)
    return out


@pytest.fixture
def no_systemd_env(monkeypatch):
    """Start from a process outside systemd, whatever runs the tests."""
    for var in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sdnotify, "_warned", False)


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_notify_sends_one_datagram(no_systemd_env, monkeypatch, abstract):
    with listening(abstract) as (sock, address):
        monkeypatch.setenv("NOTIFY_SOCKET", address)
        assert sdnotify.notify("READY=1", "STATUS=x") is True
        assert sock.recv(4096) == b"READY=1\nSTATUS=x"
        assert drain(sock) == []


def test_notify_without_systemd_is_a_no_op(no_systemd_env):
    assert sdnotify.notify("READY=1") is False


def test_notify_failure_warns_once_and_never_raises(no_systemd_env, monkeypatch, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent/omni-notify")
    with caplog.at_level(logging.WARNING, logger="omni.sdnotify"):
        assert sdnotify.notify("READY=1") is False
        assert sdnotify.notify("WATCHDOG=1") is False
    assert len([r for r in caplog.records if "sd_notify" in r.getMessage()]) == 1


def test_watchdog_interval(no_systemd_env, monkeypatch):
    assert sdnotify.watchdog_interval_s() is None
    monkeypatch.setenv("WATCHDOG_USEC", "400000")
    assert sdnotify.watchdog_interval_s() == pytest.approx(0.2)
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval_s() == pytest.approx(0.2)
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    assert sdnotify.watchdog_interval_s() is None
    monkeypatch.delenv("WATCHDOG_PID")
    for bad in ("0", "soon"):
        monkeypatch.setenv("WATCHDOG_USEC", bad)
        assert sdnotify.watchdog_interval_s() is None


def run_watchdog(healthy, seconds: float) -> None:
    async def main() -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sdnotify.watchdog(healthy), seconds)

    asyncio.run(main())


def test_watchdog_pings_while_healthy(no_systemd_env, monkeypatch):
    with listening() as (sock, address):
        monkeypatch.setenv("NOTIFY_SOCKET", address)
        monkeypatch.setenv("WATCHDOG_USEC", "100000")  # a ping every 50 ms
        run_watchdog(lambda: True, 0.5)
        pings = drain(sock)
    assert len(pings) >= 4, pings
    assert set(pings) == {b"WATCHDOG=1"}


def test_watchdog_stays_silent_while_unhealthy(no_systemd_env, monkeypatch):
    """A wedged daemon must not ping: systemd restarts it after WatchdogSec."""
    checks = []

    def healthy() -> bool:
        checks.append(len(checks) % 2 == 1)  # unhealthy, healthy, unhealthy, ...
        return checks[-1]

    def broken() -> bool:
        raise RuntimeError("supervisor gone")

    with listening() as (sock, address):
        monkeypatch.setenv("NOTIFY_SOCKET", address)
        monkeypatch.setenv("WATCHDOG_USEC", "100000")
        run_watchdog(lambda: False, 0.3)
        assert drain(sock) == []
        run_watchdog(broken, 0.3)
        assert drain(sock) == []
        run_watchdog(healthy, 0.5)
        assert len(checks) >= 4
        assert drain(sock) == [b"WATCHDOG=1"] * checks.count(True)


def test_watchdog_returns_without_watchdog(no_systemd_env, monkeypatch):
    with listening() as (sock, address):
        monkeypatch.setenv("NOTIFY_SOCKET", address)
        asyncio.run(asyncio.wait_for(sdnotify.watchdog(lambda: True), 5))  # else: TimeoutError
        assert drain(sock) == []


# --- omnid under a stand-in systemd --------------------------------------------------------


def states(datagram: bytes) -> set[str]:
    return set(datagram.decode().split("\n"))


def notify_session(argv: list[str], env: dict[str, str], log_path: Path, ready_check=None):
    """Run `argv` with a notify socket the way systemd would (WATCHDOG_USEC=400000);
    wait for READY=1, run `ready_check`, wait for a WATCHDOG=1 after it, then SIGTERM.
    Returns (datagrams, exit status)."""
    received: list[bytes] = []
    with listening() as (sock, address):
        env = {k: v for k, v in env.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_PID")}
        env |= {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "400000"}
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_path.open("w"),
            stderr=subprocess.STDOUT,
            env=env,
        )

        def log() -> str:
            return log_path.read_text()[-4000:]

        def wait_for(state: str, timeout_s: float) -> None:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                try:
                    sock.settimeout(0.5)
                    received.append(sock.recv(4096))
                except TimeoutError:
                    if proc.poll() is not None:
                        raise AssertionError(
                            f"exited ({proc.returncode}) before {state}; got {received}; "
                            f"log:\n{log()}"
                        ) from None
                    continue
                if state in states(received[-1]):
                    return
            raise AssertionError(f"no {state} in {timeout_s}s; got {received}; log:\n{log()}")

        try:
            wait_for("READY=1", 60)
            if ready_check:
                ready_check()
            wait_for("WATCHDOG=1", 10)
            proc.send_signal(signal.SIGTERM)
            try:
                status = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"still running 30s after SIGTERM; log:\n{log()}") from None
            received += drain(sock)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return received, status


def omnid_argv(port: int, runtime_dir: Path, data_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "omni.runtime.omnid",
        "--no-defaults",
        "--sandbox",
        "process",
        "--port",
        str(port),
        "--runtime-dir",
        str(runtime_dir),
        "--data-dir",
        str(data_dir),
    ]


def test_omnid_notifies_systemd(tmp_path):
    """omnid (as Type=notify) says READY=1 once it listens, pings the watchdog, and says
    STOPPING=1 on SIGTERM before exiting cleanly."""
    port = free_port()
    runtime_dir = Path(tempfile.mkdtemp(prefix="omni-"))  # short: it holds sockets
    try:

        def listens() -> None:
            assert (runtime_dir / "omnid.sock").exists(), "READY=1 before the admin socket"
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass  # READY=1 before the inference port would fail this

        received, status = notify_session(
            omnid_argv(port, runtime_dir, tmp_path / "data"),
            dict(os.environ),
            tmp_path / "omnid.log",
            ready_check=listens,
        )
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)
    log = (tmp_path / "omnid.log").read_text()[-4000:]
    assert status == 0, f"omnid exited {status}; log:\n{log}"
    all_states = [states(d) for d in received]
    ready_at = next(i for i, s in enumerate(all_states) if "READY=1" in s)
    after_ready = all_states[ready_at + 1 :]
    assert any("WATCHDOG=1" in s for s in after_ready), f"no WATCHDOG=1 after READY: {received}"
    assert any("STOPPING=1" in s for s in after_ready), f"no STOPPING=1 on SIGTERM: {received}"
