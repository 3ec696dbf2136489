"""A real omnid process for tests that drive a node through its APIs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from tests.conftest import free_port, wait_until


class Omnid:
    """omnid on a free port with `config`, its log and config in `tmp`; the runtime dir is
    short and under /tmp (Unix socket paths are limited to 107 bytes)."""

    def __init__(
        self,
        tmp: Path,
        config: str,
        *extra: str,
        runtime_dir: Path | None = None,
        env: dict[str, str] | None = None,
        netns: str | None = None,
        host: str = "127.0.0.1",
        python: str = sys.executable,
        cwd: Path | None = None,
    ):
        """`netns`: run inside that network namespace (/var/run/netns), listening on
        `host` there. `python`, `cwd`: how omnid is started (the interpreter by another
        path, `-m` from a source tree)."""
        (tmp / "omnid.toml").write_text(config)
        self.port = free_port()
        self.runtime_dir = runtime_dir or Path(tempfile.mkdtemp(prefix="omni-", dir="/tmp"))
        self.log_path = tmp / "omnid.log"
        self.host = host
        argv = [python, "-m", "omni.runtime.omnid", "--config", str(tmp / "omnid.toml")]
        if netns is not None:
            argv = ["nsenter", f"--net=/var/run/netns/{netns}", *argv, "--host", host]
        argv += ["--no-defaults", "--port", str(self.port), "--runtime-dir", str(self.runtime_dir)]
        self.proc = subprocess.Popen(
            [*argv, *extra],
            stdout=self.log_path.open("a"),  # a restarted omnid appends to the same log
            stderr=subprocess.STDOUT,
            cwd=cwd,
            # its own data dir unless the config names a state dir (never /var/lib/omni)
            env={**os.environ, "OMNI_DATA_DIR": str(tmp / "data"), **(env or {})},
        )

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def socket(self) -> Path:
        return self.runtime_dir / "omnid.sock"

    def admin(self) -> httpx.Client:
        transport = httpx.HTTPTransport(uds=str(self.socket))
        return httpx.Client(transport=transport, base_url="http://omnid", timeout=30)

    def log(self) -> str:
        return self.log_path.read_text()[-6000:]

    def instances(self) -> dict[str, dict]:
        with self.admin() as c:
            return {i["name"]: i for i in c.get("/v1/instances").json()["instances"]}

    def swap_out(self, name: str) -> None:
        """Out of GPU memory through the admin API (every rank), unless it is out already:
        an idle instance outside the hot set goes out by itself 0.2 s after its last
        request when another needs its room, a race a test on a loaded host can lose."""
        with self.admin() as c:
            r = c.post(f"/v1/instances/{name}/swap-out")
        gone = r.status_code == 409 and ("is swapped" in r.text or "is moving" in r.text)
        assert r.status_code == 200 or gone, r.text

        def out() -> bool:
            inst = self.instances()[name]
            return all(rank["residency"] == "swapped" for rank in inst.get("ranks", [inst]))

        wait_until(out, 30, f"{name} swapped out")

    def models(self) -> list[str]:
        """The catalog, once the admin API answers."""

        def listed():
            if self.proc.poll() is not None:
                raise AssertionError(f"omnid exited:\n{self.log()}")
            try:
                with self.admin() as c:
                    return c.get("/v1/models").json()  # truthy even with no models
            except httpx.TransportError:
                return None

        return sorted(m["name"] for m in wait_until(listed, 60, "the admin API")["models"])

    def wait_ready(self, names: list[str], timeout_s: float = 120) -> None:
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"omnid exited:\n{self.log()}")
            try:
                inst = self.instances()
            except httpx.TransportError:
                return False
            return all(inst.get(n, {}).get("state") == "ready" for n in names)

        wait_until(ready, timeout_s, f"instances {names} ready", interval_s=0.5)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)
