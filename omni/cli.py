"""`omni serve`: the all-in-one, omnid and omni-edge as two supervised OS processes.

One that exits is restarted with backoff while the other keeps running
(`omni.supervise` says when it gives up instead). Ctrl-C or SIGTERM stops both
within a few seconds; each child also dies with this process (PDEATHSIG), and
omnid's instances die with omnid, so nothing is left behind even if `omni serve`
itself is killed.
"""

from __future__ import annotations

import json
import signal
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import click

from omni import paths
from omni.supervise import Component, GaveUp, answers, stop_all

SETTLED = ("ready", "failed")  # a model in neither state is still starting


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _model_states(url: str) -> dict[str, str] | None:
    """Each model omnid lists at `url` (its /v1/models), by its state; None until it
    answers."""
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return {m["id"]: m.get("state", "ready") for m in json.load(resp)["data"]}
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError):
        return None


def _check_bind(_ctx, _param, value: str | None) -> str | None:
    """--edge-dashboard: HOST:PORT, PORT or 'off', refused here as the edge would."""
    if value is None or value.strip().lower() == "off":
        return value
    from omni.api.live import parse_bind  # (aiohttp: not for every `omni` command)

    try:
        parse_bind(value, "--edge-dashboard")
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


def _check_grpc_port(_ctx, _param, value: str | None) -> str | None:
    """--grpc-port: PORT, HOST:PORT or 'off', refused here as the edge would."""
    if value is None:
        return value
    from omni.api.oip_grpc import parse_port  # (grpc: not for every `omni` command)

    try:
        parse_port(value, "127.0.0.1")
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


@dataclass
class Announcer:
    """What `omni serve` tells its user of the start: "starting" once the edge answers,
    then "serving on" once every model answers (or failed) and the edge routes to them."""

    url: str  # the public endpoint
    edge_health: str
    omnid_models: str  # omnid's model list, with each one's state
    admin: Path  # omnid's admin socket
    said_starting: bool = False
    announced: bool = False

    def check(self) -> str | None:
        """The next line to say, if any."""
        if self.announced:
            return None
        states = _model_states(self.omnid_models)
        if states is None:
            return None
        loading = sorted(n for n, s in states.items() if s not in SETTLED)
        if loading:
            if self.said_starting or not answers(self.edge_health):
                return None
            self.said_starting = True
            return f"omni: starting on {self.url}: loading {', '.join(loading)}..."
        # no model: the edge never reports healthy, its answering is all there is to wait for
        if not (_healthy(self.edge_health) if states else answers(self.edge_health)):
            return None
        self.announced = True
        ready = sorted(n for n, s in states.items() if s == "ready")
        failed = sorted(n for n, s in states.items() if s == "failed")
        models = f"models ready: {', '.join(ready) or 'none'}" if states else "no models"
        if failed:
            models += f"; failed: {', '.join(failed)} (omnictl instances says why)"
        return f"omni: serving on {self.url} ({models}; admin: omnictl --socket {self.admin})"


@click.group()
def main() -> None:
    """OMNI: a sandboxed multi-model inference runtime."""


@main.command()
@click.option(
    "--host",
    default="127.0.0.1",
    envvar="OMNI_EDGE_HOST",
    show_default=True,
    help="Address the edge (public endpoint) listens on [$OMNI_EDGE_HOST].",
)
@click.option(
    "--port",
    default=8080,
    envvar="OMNI_EDGE_PORT",
    show_default=True,
    help="Port the edge (public endpoint) listens on [$OMNI_EDGE_PORT].",
)
@click.option(
    "--omnid-port",
    default=8081,
    envvar="OMNID_PORT",
    show_default=True,
    help="Port of omnid's inference endpoint on 127.0.0.1, which the edge forwards to "
    "[$OMNID_PORT].",
)
@click.option(
    "--edge-dashboard",
    envvar="OMNI_EDGE_DASHBOARD",
    default=None,
    metavar="HOST:PORT|off",
    callback=_check_bind,
    help="The edge's read-only dashboard: HOST:PORT or PORT (loopback unless an address "
    "is written out), or 'off' [$OMNI_EDGE_DASHBOARD; default: 127.0.0.1:9180].",
)
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
@click.option("--max-body-bytes", type=int, default=None, help="Edge request size limit, in bytes.")
@click.option(
    "--grpc-port",
    envvar="OMNI_GRPC_PORT",
    default=None,
    metavar="PORT|HOST:PORT|off",
    callback=_check_grpc_port,
    help="The edge's Open Inference Protocol over gRPC [$OMNI_GRPC_PORT; default: 8001 on "
    "--host, skipped with a warning if taken].",
)
def serve(
    host, port, omnid_port, edge_dashboard, runtime_dir, data_dir, config, max_body_bytes, grpc_port
) -> None:
    """Run omnid and omni-edge on this machine until Ctrl-C, restarting either if it exits.
    "serving on" is printed once every model answers."""
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
        "--grpc-port",
        "off",  # the edge's is the public one
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
    if edge_dashboard is not None:
        edge += ["--dashboard", edge_dashboard]
    if grpc_port is not None:
        edge += ["--grpc-port", grpc_port]

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
    announcer = Announcer(
        f"http://{host}:{port}/v1",
        f"http://{host}:{port}/healthz",
        f"http://127.0.0.1:{omnid_port}/v1/models",
        paths.admin_socket(runtime_dir),
    )
    try:
        for component in components:
            component.start()
        while not stopping:
            for component in components:
                if line := component.check():
                    click.echo(f"omni: {line}", err=True)
            if line := announcer.check():
                click.echo(line, err=True)
            time.sleep(0.2)
    except GaveUp as exc:
        click.echo(f"omni: {exc}; stopping", err=True)
        raise SystemExit(1) from None
    finally:
        stop_all([c.proc for c in components if c.proc is not None])
    click.echo("omni: stopped", err=True)


if __name__ == "__main__":
    main()
