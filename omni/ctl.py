"""omnictl: the admin CLI, over omnid's Unix socket."""

from __future__ import annotations

import json
import sys
import time
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
    rows = data[key]
    columns = [c for c in columns if any(r.get(c) is not None for r in rows)] or columns
    table = Table(box=None, header_style="bold")
    for col in columns:
        table.add_column(col.upper(), overflow="fold")
    for row in rows:
        table.add_row(*("-" if row.get(c) is None else str(row.get(c)) for c in columns))
    console = Console()
    if not console.is_terminal:  # piped: never squeeze names to fit 80 columns
        console = Console(width=400)
    console.print(table)


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
    """List the catalog, with each model's state ("drained": stopped by a drain)."""
    data = ctx.obj["admin"].call("GET", "/v1/models")
    _emit(ctx, data, "models", ["name", "kind", "origin", "state", "path"])


def _act(ctx: click.Context, method: str, path: str, summary, **kwargs) -> None:
    """One admin call: its JSON answer with --json, else a one-line summary of it."""
    data = ctx.obj["admin"].call(method, path, **kwargs)
    click.echo(json.dumps(data, indent=2) if ctx.obj["json"] else summary(data))


def _mib(value) -> str | None:
    return None if value is None else f"{value / (1 << 20):.0f}"


def _ago(unix: float | None) -> str | None:
    return None if unix is None else f"{time.time() - unix:.0f}s"


@main.command()
@click.pass_context
def instances(ctx: click.Context) -> None:
    """List instances: state, residency, GPU memory, swaps, last use."""
    data = ctx.obj["admin"].call("GET", "/v1/instances")
    for row in data["instances"]:
        row["quota_mib"] = _mib(row.get("quota_bytes"))
        row["used_mib"] = _mib(row.get("used_bytes"))
        row["swaps"] = f"{row['swaps_in']}/{row['swaps_out']}" if row.get("residency") else None
        if not ctx.obj["json"]:  # the table says how long ago; JSON keeps the unix time
            row["last_used"] = _ago(row.get("last_used"))
    _emit(
        ctx,
        data,
        "instances",
        [
            "name",
            "version",
            "state",
            "residency",
            "gpu",
            "quota_mib",
            "used_mib",
            "swaps",
            "in_flight",
            "last_used",
            "pid",
            "restarts",
            "last_exit",
        ],
    )
    if not ctx.obj["json"]:
        for row in data["instances"]:
            if row.get("failure"):
                click.echo(f"{row['name']} failed: {row['failure']}")
        if line := _drain_line(data):
            click.echo(line)


def _drain_line(data: dict) -> str | None:
    """What a drain did to the node, and how to undo it; None when it serves."""
    if data.get("drained"):
        stopped = ", ".join(data["drained"])
        return f"node drained: {stopped} stopped; `omnictl undrain` starts them again"
    if data.get("draining"):
        return "node draining: new requests refused; `omnictl undrain` takes them again"
    return None


@main.command()
@click.argument("name")
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--gpu", type=int, help="Place it on this GPU (needs --quota).")
@click.option("--quota", help="GPU memory quota, e.g. 4GiB.")
@click.option("--permits", type=int, help="Requests at the instance at once.")
@click.option("--cold", is_flag=True, help="Load, then swap out until first used.")
@click.option("--memory", help="Host memory limit, e.g. 16GiB.")
@click.option("--runtime", type=click.Choice(["omni", "python"]), help="What runs it.")
@click.option("--handler", help='With --runtime python: "file.py:Class" or "module:Class".')
@click.pass_context
def load(ctx: click.Context, name: str, path: Path, **options) -> None:
    """Add the HF checkpoint directory PATH (or, with --runtime python, a handler's model
    directory) to the catalog as NAME and start it.

    The catalog change survives omnid restarts."""
    body = {"name": name, "path": str(path.resolve())}
    # `is`, not `in`: 0 == False, and --gpu 0 is a choice (issue 50); an unset flag is left out.
    body.update({k: v for k, v in options.items() if v is not None and v is not False})
    _act(ctx, "POST", "/v1/models", lambda _d: f"loaded {name}", json=body)


@main.command("swap-out")
@click.argument("name")
@click.pass_context
def swap_out(ctx: click.Context, name: str) -> None:
    """Move NAME's GPU memory to host memory now (it must be idle)."""
    _act(ctx, "POST", f"/v1/instances/{name}/swap-out", lambda d: f"{name}: {d['residency']}")


@main.command("swap-in")
@click.argument("name")
@click.pass_context
def swap_in(ctx: click.Context, name: str) -> None:
    """Bring NAME's memory back to its GPU now (swapping out others if needed)."""
    _act(ctx, "POST", f"/v1/instances/{name}/swap-in", lambda d: f"{name}: {d['residency']}")


@main.command()
@click.pass_context
def node(ctx: click.Context) -> None:
    """The node: draining or not, which sandbox limits hold, and each GPU's budget and
    resident instances."""
    data = ctx.obj["admin"].call("GET", "/v1/node")
    if ctx.obj["json"]:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(f"draining: {data['draining']}, instances: {data['instances']}")
    if line := _drain_line(data):
        click.echo(line)
    for line in _sandbox_lines(data.get("sandbox")):
        click.echo(line)
    for gpu in data["gpus"]:
        click.echo(
            f"gpu {gpu['index']}: {_mib(gpu['charged_bytes'])}/{_mib(gpu['budget_bytes'])} MiB "
            f"charged, resident: {', '.join(gpu['resident']) or '-'}, waiting: {gpu['waiting']}"
        )


def _sandbox_lines(sandbox: dict | None) -> list[str]:
    """The sandbox's line (`sandbox: isolated (cgroup v1, seccomp on); enforced: memory,
    ...; NOT enforced: -`), and one for the config's required limits that do not hold."""
    if not sandbox:
        return []
    how = sandbox["mode"]
    if sandbox["mode"] == "isolated":
        seccomp = "on" if sandbox["seccomp"] else "off"
        how += f" (cgroup v{sandbox['cgroup_version']}, seccomp {seccomp})"
    held = [k for k, v in sandbox["enforced"].items() if v]
    not_held = [k for k, v in sandbox["enforced"].items() if not v]
    lines = [
        f"sandbox: {how}; enforced: {', '.join(held) or '-'}; "
        f"NOT enforced: {', '.join(not_held) or '-'}"
    ]
    if sandbox.get("missing"):
        lines.append(
            f"required but NOT enforced: {', '.join(sandbox['missing'])} "
            "(require_limits): no instance starts"
        )
    return lines


@main.command()
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=9181,
    show_default=True,
    help="Loopback port to serve it on (0: any free one).",
)
@click.pass_context
def dashboard(ctx: click.Context, port: int) -> None:
    """Serve omnid's live dashboard on http://127.0.0.1:PORT/ until Ctrl-C: read-only,
    forwarded to the admin socket."""
    import asyncio

    from omni import dashboard_proxy

    socket = ctx.obj["admin"].socket

    def ready(url: str) -> None:
        click.echo(f"omnid's dashboard: {url} (Ctrl-C to stop)", err=True)

    try:
        asyncio.run(dashboard_proxy.serve(socket, port, ready))
    except OSError as exc:
        raise click.ClickException(f"cannot serve the dashboard: {exc}") from None
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.pass_context
def drain(ctx: click.Context) -> None:
    """Stop taking requests, let those in flight finish, then stop every instance
    (`omnictl undrain` undoes it)."""
    _act(ctx, "POST", "/v1/node/drain", lambda _d: "draining")


@main.command()
@click.pass_context
def undrain(ctx: click.Context) -> None:
    """Undo `drain`: take requests again, and start again the instances it stopped."""
    _act(
        ctx,
        "POST",
        "/v1/node/undrain",
        lambda d: f"serving; started again: {', '.join(d['started']) or 'none'}",
    )


@main.command()
@click.argument("name")
@click.pass_context
def unload(ctx: click.Context, name: str) -> None:
    """Stop NAME's instance and remove it from the catalog."""
    _act(ctx, "DELETE", f"/v1/models/{name}", lambda _d: f"unloaded {name}")


@main.command()
@click.argument("name")
@click.pass_context
def restart(ctx: click.Context, name: str) -> None:
    """Restart NAME's instance."""
    _act(ctx, "POST", f"/v1/instances/{name}/restart", lambda _d: f"restarting {name}")


@main.group()
@click.option(
    "--etcd",
    envvar="OMNI_ETCD",
    default="127.0.0.1:2379",
    show_default=True,
    help="The cluster's etcd, HOST:PORT [$OMNI_ETCD].",
)
@click.pass_context
def cluster(ctx: click.Context, etcd: str) -> None:
    """The cluster as etcd holds it: nodes, placements, leader, latency, autoscaling."""
    ctx.obj["etcd"] = etcd


def _cluster_read(ctx: click.Context, read) -> dict:
    """Run `read(store)` against the cluster's etcd; a clear error when it is unreachable."""
    import asyncio

    # Here, not at the top: aetcd (gRPC) loads only for the cluster commands.
    from omni.cluster.membership import parse_endpoint
    from omni.cluster.state import ClusterStore

    async def go() -> dict:
        store = ClusterStore(*parse_endpoint(ctx.obj["etcd"]))
        try:
            return await asyncio.wait_for(read(store), 10)
        finally:
            await store.close()

    try:
        return asyncio.run(go())
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    except Exception as exc:  # the client's connection errors have no common base
        raise click.ClickException(f"cannot read etcd at {ctx.obj['etcd']}: {exc}") from None


@cluster.command("nodes")
@click.pass_context
def cluster_nodes(ctx: click.Context) -> None:
    """Nodes announced in etcd (alive: their lease is being renewed)."""

    async def read(store) -> dict:
        placed = await store.placements()
        rows = []
        for node_id, rec in sorted((await store.nodes()).items()):
            models = sorted(k.split("/", 1)[1] for k in placed if k.startswith(node_id + "/"))
            gpus = rec.get("gpus") or []
            budget = sum(g.get("budget_bytes", 0) for g in gpus)
            rows.append(
                {
                    "id": node_id,
                    "location": rec.get("location"),
                    "url": rec.get("url"),
                    "gpus": len(gpus) or None,
                    "budget_mib": _mib(budget) if gpus else None,
                    "placed": ", ".join(models) or None,
                }
            )
        return {"nodes": rows}

    _emit(
        ctx,
        _cluster_read(ctx, read),
        "nodes",
        ["id", "location", "url", "gpus", "budget_mib", "placed"],
    )


@cluster.command("placements")
@click.pass_context
def cluster_placements(ctx: click.Context) -> None:
    """What the scheduler wants where, the leader that decided it, and the state each
    node reports of it (none yet: not converged)."""

    async def read(store) -> dict:
        from omni.cluster.state import Election  # aetcd (gRPC) only when run

        nodes = await store.nodes()
        observed = await store.observed()
        rows = []
        for key, spec in sorted((await store.placements()).items()):
            node_id, model = key.split("/", 1)
            quota = spec.get("quota")
            rows.append(
                {
                    "model": model,
                    "node": node_id,
                    "alive": node_id in nodes,
                    "state": observed.get(key, {}).get("state"),  # what the node reports
                    "replica": spec.get("replica"),
                    "version": spec.get("version"),
                    "gpu": spec.get("gpu"),
                    "quota_mib": _mib(quota) if isinstance(quota, int) else None,
                    "path": spec.get("path"),
                }
            )
        return {"leader": await Election(store, "omnictl").leader(), "placements": rows}

    data = _cluster_read(ctx, read)
    if not ctx.obj["json"]:
        click.echo(f"leader: {data['leader'] or 'none'}")
    columns = [
        "model", "node", "alive", "state", "replica", "version", "gpu", "quota_mib", "path"
    ]  # fmt: skip
    _emit(ctx, data, "placements", columns)


def _table(columns: list[str], rows: list[list[str | None]]) -> None:
    """A plain table, headers as given (they are names: locations, nodes)."""
    table = Table(box=None, header_style="bold")
    for col in columns:
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*("-" if v is None else v for v in row))
    console = Console()
    if not console.is_terminal:
        console = Console(width=400)
    console.print(table)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


@cluster.command("latency")
@click.pass_context
def cluster_latency(ctx: click.Context) -> None:
    """The latency map the scheduler publishes: median RTT (ms) between locations, and
    each node's row (its probes of the others; "no answer": probed, none came)."""

    async def read(store) -> dict:
        from omni.cluster.latency import read_map  # aetcd (gRPC) only when run

        latency_map = await read_map(store)
        if latency_map is None:
            return {"at": None, "matrix_ms": {}, "locations": {}, "rows_ms": {}}
        return {
            "at": latency_map.at,
            "matrix_ms": {
                x: {y: _ms(rtt) for y, rtt in row.items()}
                for x, row in latency_map.matrix().items()
            },
            "locations": latency_map.locations,
            "rows_ms": {
                node: {peer: _ms(rtt) for peer, rtt in sorted(row.items())}
                for node, row in sorted(latency_map.rows.items())
            },
        }

    data = _cluster_read(ctx, read)
    if ctx.obj["json"]:
        click.echo(json.dumps(data, indent=2))
        return
    if data["at"] is None:
        click.echo("no latency map published (is a scheduler leading?)")
        return
    nodes = sorted(data["locations"])
    click.echo(f"latency map of {len(nodes)} nodes, published {_ago(data['at'])} ago (ms)")
    matrix = data["matrix_ms"]
    locations = sorted(set(data["locations"].values()) | set(matrix))
    _table(
        ["", *locations],
        [[x, *(_fmt_ms(matrix.get(x, {}).get(y)) for y in locations)] for x in locations],
    )
    click.echo()
    rows = data["rows_ms"]
    _table(
        ["node", "location", *nodes],
        [
            [
                n,
                data["locations"].get(n),
                *(
                    None if n == p or p not in rows.get(n, {}) else _fmt_ms(rows[n][p], "no answer")
                    for p in nodes
                ),
            ]
            for n in nodes
        ],
    )


def _fmt_ms(ms: float | None, missing: str | None = None) -> str | None:
    return missing if ms is None else f"{ms:.2f}"


# scheduler/service.py's AUTOSCALE (not imported from there: it would load gRPC).
_AUTOSCALE_KEY = b"/omni/autoscale"


@cluster.command("forecast")
@click.pass_context
def cluster_forecast(ctx: click.Context) -> None:
    """The leader's latest autoscaling decision per model: replicas wanted (between MIN
    and MAX), how many are placed, why, the demand now and the forecast peak over the
    next cold start (in replicas' worth of work)."""

    async def read(store) -> dict:
        import orjson

        from omni.cluster.state import Election  # aetcd (gRPC) only when run

        kv = await store.client.get(_AUTOSCALE_KEY)
        decisions = orjson.loads(kv.value) if kv is not None else {}
        placed: dict[str, int] = {}
        for key in await store.placements():
            model = key.split("/", 1)[1]
            placed[model] = placed.get(model, 0) + 1
        rows = [
            {"model": model, **d, "placed": placed.get(model, 0)}
            for model, d in sorted(decisions.items())
        ]
        return {"leader": await Election(store, "omnictl").leader(), "models": rows}

    data = _cluster_read(ctx, read)
    if not ctx.obj["json"]:
        click.echo(f"leader: {data['leader'] or 'none'}")
        for row in data["models"]:
            row["demand"] = _fmt_num(row.get("demand"))
            row["predicted"] = _fmt_num(row.get("predicted"))
            row["age"] = _ago(row.get("at"))
    columns = ["model", "replicas", "placed", "min", "max", "reason", "demand", "predicted"]
    _emit(ctx, data, "models", [*columns, "age"])


@cluster.group("rollout")
def rollout() -> None:
    """Gradual rollouts of a model's new version: start one, abort one, watch them."""


def _steps(_ctx, _param, value: str) -> list[float]:
    try:
        return [float(s) for s in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"{value!r}: percentages separated by commas") from None


@rollout.command("start")
@click.argument("model")
@click.argument("version")
@click.argument("path")
@click.option(
    "--steps", default="10,50,100", show_default=True, callback=_steps,
    help="Percent of replicas on the new version at each stage, ending at 100.",
)  # fmt: skip
@click.option("--step-time", default=300.0, show_default=True, help="Seconds per stage, at least.")
@click.option(
    "--min-requests", default=100, show_default=True,
    help="Requests the new version serves before it is judged and a stage may end.",
)  # fmt: skip
@click.option(
    "--tolerance", default=0.01, show_default=True,
    help="How far its error rate may exceed the old version's before it is rolled back.",
)  # fmt: skip
@click.option(
    "--max-restarts", default=2, show_default=True,
    help="Restarts of a new-version instance that roll it back.",
)  # fmt: skip
@click.pass_context
def rollout_start(
    ctx: click.Context, model: str, version: str, path: str, steps: list[float], **options
) -> None:
    """Roll MODEL out to VERSION, whose checkpoint is at PATH on the nodes. The scheduler's
    leader moves it stage by stage and rolls it back on its own when it errs more than the
    version it replaces (`omnictl cluster rollout status`)."""
    import uuid

    from omni.cluster.rollout import ROLLOUTS, RolloutRequest  # aetcd (gRPC) only when run

    try:
        req = RolloutRequest(
            id=uuid.uuid4().hex[:12],
            version=version,
            path=path,
            steps=tuple(steps),
            step_s=options["step_time"],
            min_requests=options["min_requests"],
            tolerance=options["tolerance"],
            max_restarts=options["max_restarts"],
        )
        req.check()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None

    async def write(store) -> dict:
        import orjson

        placed = [k for k in await store.placements() if k.split("/", 1)[1] == model]
        await store.client.put(ROLLOUTS + model.encode(), orjson.dumps(req.to_json()))
        return {"rollout": req.to_json(), "placed": len(placed)}

    data = _cluster_read(ctx, write)
    if ctx.obj["json"]:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(f"rollout {req.id}: {model} to {version} in steps {steps}")
    if not data["placed"]:
        click.echo(f"warning: {model} is placed on no node now", err=True)


@rollout.command("abort")
@click.argument("model")
@click.pass_context
def rollout_abort(ctx: click.Context, model: str) -> None:
    """Roll MODEL's rollout in progress back to the version it replaces."""
    from omni.cluster.rollout import ROLLOUTS  # aetcd (gRPC) only when run

    async def write(store) -> dict:
        import orjson

        kv = await store.client.get(ROLLOUTS + model.encode())
        if kv is None:
            return {"aborted": None}
        value = {**orjson.loads(kv.value), "abort": True}
        await store.client.put(ROLLOUTS + model.encode(), orjson.dumps(value))
        return {"aborted": value.get("id")}

    data = _cluster_read(ctx, write)
    if data["aborted"] is None:
        raise click.ClickException(f"no rollout of {model}")
    click.echo(json.dumps(data) if ctx.obj["json"] else f"rollout {data['aborted']}: aborting")


@rollout.command("status")
@click.pass_context
def rollout_status(ctx: click.Context) -> None:
    """Each model's latest rollout as the leader carries it out: state (rolling, done,
    rolled-back, refused), stage, share of replicas, and the two versions' error rates."""

    async def read(store) -> dict:
        from omni.cluster.rollout import ROLLOUT_STATUS, ROLLOUTS  # aetcd (gRPC) only when run

        asked = await store.get_prefix(ROLLOUTS)
        statuses = await store.get_prefix(ROLLOUT_STATUS)
        rows = []
        for model in sorted(asked.keys() | statuses.keys()):
            req, st = asked.get(model, {}), statuses.get(model, {})
            if st.get("id") != req.get("id"):
                st = {"state": "pending"}  # the leader has not taken it up yet
            rows.append(
                {
                    "model": model,
                    "id": req.get("id"),
                    "version": req.get("version"),
                    "from": (st.get("previous") or {}).get("version"),
                    "state": st.get("state"),
                    "percent": st.get("percent"),
                    "new": st.get("new"),
                    "old": st.get("old"),
                    "reason": st.get("reason"),
                }
            )
        return {"rollouts": rows}

    data = _cluster_read(ctx, read)
    if not ctx.obj["json"]:
        for row in data["rollouts"]:
            for side in ("new", "old"):
                c = row[side]
                row[side] = c and f"{c['errors']}/{c['requests']}"
    columns = ["model", "version", "from", "state", "percent", "new", "old", "reason"]
    _emit(ctx, data, "rollouts", columns)


def _fmt_num(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
