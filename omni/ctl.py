"""omnictl: the admin CLI, over omnid's Unix socket."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import httpx
from rich.console import Console
from rich.table import Table

from omni import paths


class Admin:
    def __init__(self, socket: Path):
        self.socket = socket
        self.client = httpx.Client(
            transport=httpx.HTTPTransport(uds=str(socket)), base_url="http://omnid", timeout=60
        )

    def call(self, method: str, path: str, **kwargs) -> dict:
        try:
            resp = self.client.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise click.ClickException(f"cannot reach omnid at {self.socket}: {exc}") from None
        data = resp.json()
        if resp.status_code >= 400:
            raise click.ClickException(data.get("error", {}).get("message", resp.text))
        return data


def _emit(ctx: click.Context, data: dict, key: str, columns: list[str]) -> None:
    if ctx.obj["json"]:
        click.echo(json.dumps(data, indent=2))
        return
    table = Table(box=None, header_style="bold")
    for col in columns:
        table.add_column(col.upper())
    for row in data[key]:
        table.add_row(*("-" if row.get(c) is None else str(row.get(c)) for c in columns))
    Console().print(table)


@click.group()
@click.option(
    "--socket",
    type=click.Path(path_type=Path),
    default=None,
    help="omnid admin socket [default: $OMNI_RUNTIME_DIR/omnid.sock].",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def main(ctx: click.Context, socket: Path | None, as_json: bool) -> None:
    """Inspect and control the omnid on this node."""
    socket = socket or paths.admin_socket(paths.runtime_dir())
    ctx.obj = {"admin": Admin(socket), "json": as_json}


@main.command()
@click.pass_context
def models(ctx: click.Context) -> None:
    """List the catalog."""
    data = ctx.obj["admin"].call("GET", "/v1/models")
    _emit(ctx, data, "models", ["name", "kind", "origin", "path"])


@main.command()
@click.pass_context
def instances(ctx: click.Context) -> None:
    """List instances: state, pid, uptime, restarts."""
    data = ctx.obj["admin"].call("GET", "/v1/instances")
    _emit(
        ctx,
        data,
        "instances",
        ["name", "kind", "state", "pid", "uptime_s", "restarts", "last_exit"],
    )


@main.command()
@click.argument("name")
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.pass_context
def load(ctx: click.Context, name: str, path: Path) -> None:
    """Add the HF checkpoint directory PATH to the catalog as NAME and start it."""
    data = ctx.obj["admin"].call(
        "POST", "/v1/models", json={"name": name, "path": str(path.resolve())}
    )
    click.echo(json.dumps(data, indent=2) if ctx.obj["json"] else f"loaded {name}")


@main.command()
@click.argument("name")
@click.pass_context
def unload(ctx: click.Context, name: str) -> None:
    """Stop NAME's instance and remove it from the catalog."""
    data = ctx.obj["admin"].call("DELETE", f"/v1/models/{name}")
    click.echo(json.dumps(data, indent=2) if ctx.obj["json"] else f"unloaded {name}")


@main.command()
@click.argument("name")
@click.pass_context
def restart(ctx: click.Context, name: str) -> None:
    """Restart NAME's instance."""
    data = ctx.obj["admin"].call("POST", f"/v1/instances/{name}/restart")
    click.echo(json.dumps(data, indent=2) if ctx.obj["json"] else f"restarting {name}")


if __name__ == "__main__":
    sys.exit(main())
