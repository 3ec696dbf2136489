"""`omni serve`: the all-in-one, omnid and omni-edge as two supervised OS processes.

One that exits is restarted with backoff while the other keeps running
(`omni.supervise` says when it gives up instead). Ctrl-C or SIGTERM stops both
within a few seconds; each child also dies with this process (PDEATHSIG), and
omnid's instances die with omnid, so nothing is left behind even if `omni serve`
itself is killed.
"""

from __future__ import annotations

import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import click

from omni import paths
from omni.supervise import Component, GaveUp, stop_all


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


@click.group()
def main() -> None:
    """OMNI: a sandboxed multi-model inference runtime."""


@main.command()
@click.option(
    "--host",
    default="127.0.0.1",
    envvar="OMNI_EDGE_HOST",
    show_default=True,
    help="Address the edge (public endpoint) listens on.",
)
@click.option("--port", default=8080, envvar="OMNI_EDGE_PORT", show_default=True)
@click.option("--omnid-port", default=8081, envvar="OMNID_PORT", show_default=True)
@click.option(
    "--runtime-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Sockets [default: $OMNI_RUNTIME_DIR, /run/omni as root].",
)
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Converted models [default: $OMNI_DATA_DIR, /var/lib/omni as root].",
)
@click.option(
    "--config",
    type=click.Path(path_type=Path),
    default=None,
    help="omnid TOML config with [[models]] entries.",
)
@click.option("--max-body-bytes", type=int, default=None, help="Edge request size limit.")
def serve(host, port, omnid_port, runtime_dir, data_dir, config, max_body_bytes) -> None:
    """Run omnid and omni-edge on this machine until Ctrl-C, restarting either if it exits."""
    runtime_dir = runtime_dir or paths.runtime_dir()
    data_dir = data_dir or paths.data_dir()
    omnid = [
        sys.executable,
        "-m",
        "omni.runtime.omnid",
        "--port",
        str(omnid_port),
        "--runtime-dir",
        str(runtime_dir),
        "--data-dir",
        str(data_dir),
    ]
    if config:
        omnid += ["--config", str(config)]
    edge = [
        sys.executable,
        "-m",
        "edge.server",
        "--host",
        host,
        "--port",
        str(port),
        "--upstream",
        f"http://127.0.0.1:{omnid_port}",
    ]
    if max_body_bytes:
        edge += ["--max-body-bytes", str(max_body_bytes)]

    stopping = False

    def on_signal(_sig, _frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    components = [
        Component("omnid", omnid, f"http://127.0.0.1:{omnid_port}/healthz"),
        Component("edge", edge, f"http://{host}:{port}/healthz"),
    ]
    announced = False
    try:
        for component in components:
            component.start()
        while not stopping:
            for component in components:
                if line := component.check():
                    click.echo(f"omni: {line}", err=True)
            if not announced and _healthy(f"http://{host}:{port}/healthz"):
                click.echo(
                    f"omni: serving on http://{host}:{port}/v1 "
                    f"(admin: omnictl --socket {paths.admin_socket(runtime_dir)})",
                    err=True,
                )
                announced = True
            time.sleep(0.2)
    except GaveUp as exc:
        click.echo(f"omni: {exc}; stopping", err=True)
        raise SystemExit(1) from None
    finally:
        stop_all([c.proc for c in components if c.proc is not None])
    click.echo("omni: stopped", err=True)


if __name__ == "__main__":
    main()
