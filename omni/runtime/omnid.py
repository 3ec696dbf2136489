"""omnid, the per-node daemon: catalog, instance supervision, inference and admin APIs.

- HTTP (TCP) inference endpoint: OpenAI-compatible, routed to the model's instance.
- Admin API (HTTP/JSON on a Unix socket): list, load, unload, restart; `omnictl` speaks it.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

from aiohttp import web

from omni import paths
from omni.api.errors import ApiError, error_middleware, json_response, model_not_found, unavailable
from omni.api.proxy import relay
from omni.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    parse_request,
)
from omni.engine.checkpoint import CheckpointError
from omni.isolation import seccomp
from omni.isolation.cgroups import CgroupError, CgroupManager
from omni.isolation.isolated import IsolatedSandbox
from omni.isolation.sandbox import ProcessSandbox, SandboxSpec
from omni.isolation.view import ViewConfig
from omni.logs import setup_logging

from .catalog import CatalogError, ModelEntry, load_config
from .defaults import MINILM_PACKAGE, SMOLLM_PACKAGE, default_entries, package_dir
from .instance import Instance, SandboxFactory

log = logging.getLogger("omnid")

SANDBOX_UID_BASE = 200_000  # outside the range of any real account
MAX_UNIX_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
# endpoint -> (schema, model kind that serves it)
ENDPOINTS = {
    "/v1/chat/completions": (ChatCompletionRequest, "generate"),
    "/v1/completions": (CompletionRequest, "generate"),
    "/v1/embeddings": (EmbeddingRequest, "embed"),
}


class Node:
    """The node's catalog and one supervised instance per model."""

    def __init__(self, runtime_dir: Path, ready_wait_s: float = 30.0):
        self.socket_dir = paths.instance_socket_dir(runtime_dir)
        self.ready_wait_s = ready_wait_s
        self.instances: dict[str, Instance] = {}
        self.started = int(time.time())
        self.sandbox_factory: SandboxFactory = ProcessSandbox
        self._uids: dict[str, int] = {}

    def sandbox_uid(self, name: str) -> int:
        """Each instance its own unprivileged uid: no shared files, signals or rlimits."""
        if name not in self._uids:
            self._uids[name] = SANDBOX_UID_BASE + len(self._uids)
        return self._uids[name]

    def hidden_paths(self) -> tuple[Path, ...]:
        """Every model's files: each sandbox must see its own model only."""
        sources = [package_dir(SMOLLM_PACKAGE), package_dir(MINILM_PACKAGE)]
        return tuple(i.entry.path for i in self.instances.values()) + tuple(
            p for p in sources if p is not None
        )

    def add(self, entry: ModelEntry) -> Instance:
        if entry.name in self.instances:
            raise ApiError(
                409, f"Model '{entry.name}' is already loaded.", param="name", code="model_exists"
            )
        socket_path = self.socket_dir / entry.name / "sock"
        if len(os.fsencode(socket_path)) > MAX_UNIX_PATH:
            raise ApiError(
                400,
                f"Socket path {socket_path} is longer than {MAX_UNIX_PATH} "
                "bytes; use a shorter runtime dir or model name.",
                param="name",
            )
        inst = Instance(entry, self.socket_dir, self.sandbox_factory)
        self.instances[entry.name] = inst
        inst.start()
        return inst

    async def remove(self, name: str) -> None:
        inst = self.instances.pop(name, None)
        if inst is None:
            raise model_not_found(name)
        await inst.stop()

    async def shutdown(self) -> None:
        await asyncio.gather(*(inst.stop() for inst in self.instances.values()))
        self.instances.clear()

    def get(self, name: str) -> Instance:
        inst = self.instances.get(name)
        if inst is None:
            raise model_not_found(name)
        return inst


def sandbox_factory(mode: str, runtime_dir: Path, node: Node) -> SandboxFactory:
    """How instances are started: isolated (root: cgroups + namespaces) or plain processes."""
    if mode == "process" or (mode == "auto" and os.geteuid() != 0):
        if mode == "auto":
            log.warning("not root: instances run as plain processes, without a sandbox")
        return ProcessSandbox
    try:
        # One scope per runtime dir: several omnids may share a cgroup (tests), and a
        # restarted omnid finds its predecessor's leftovers to clean up.
        scope = hashlib.sha1(str(runtime_dir.resolve()).encode()).hexdigest()[:12]
        cgroups = CgroupManager.detect(scope)
    except (CgroupError, OSError) as exc:
        if mode == "isolated":
            raise CatalogError(f"--sandbox isolated: cgroups unavailable ({exc})") from None
        log.warning("cgroups unavailable (%s): instances run as plain processes", exc)
        return ProcessSandbox
    workdir = runtime_dir / "sandboxes"
    workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        bpf = seccomp.export_bpf(workdir / "seccomp.bpf")
    except (OSError, RuntimeError) as exc:  # libseccomp missing: still isolated, less so
        log.warning("no seccomp filter for instances: %s", exc)
        bpf = None
    log.info(
        "sandboxing instances (cgroup v%d, seccomp %s)", cgroups.version, "on" if bpf else "off"
    )

    def make(spec: SandboxSpec) -> IsolatedSandbox:
        uid = node.sandbox_uid(spec.name)
        return IsolatedSandbox(
            replace(spec, hide=node.hidden_paths()),
            cgroups,
            workdir,
            view=ViewConfig(uid=uid, gid=uid),
            seccomp_bpf=bpf,
        )

    return make


def inference_app(node: Node) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=64 << 20)

    async def models(_request: web.Request) -> web.Response:
        data = [
            {"id": name, "object": "model", "created": node.started, "owned_by": "omni"}
            for name in sorted(node.instances)
        ]
        return json_response({"object": "list", "data": data})

    async def infer(request: web.Request) -> web.StreamResponse:
        schema, kind = ENDPOINTS[request.path]
        body = await request.read()
        req = parse_request(schema, body)
        inst = node.get(req.model)
        if inst.entry.kind != kind:
            raise ApiError(
                400,
                f"Model '{req.model}' does not serve {request.path}.",
                param="model",
                code="wrong_model_kind",
            )
        if not await inst.wait_ready(node.ready_wait_s):
            raise unavailable(
                f"Model '{req.model}' is {inst.state}; retry shortly.", inst.retry_after_s()
            )
        return await relay(
            request,
            inst.session,
            inst.url(request.path),
            body,
            upstream_name=f"instance of '{req.model}'",
            retry_after_s=inst.retry_after_s(),
        )

    async def healthz(_request: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    app.router.add_get("/v1/models", models)
    app.router.add_get("/healthz", healthz)
    for path in ENDPOINTS:
        app.router.add_post(path, infer)
    return app


def admin_app(node: Node) -> web.Application:
    app = web.Application(middlewares=[error_middleware])

    async def list_models(_request: web.Request) -> web.Response:
        return json_response({"models": [i.entry.to_json() for i in node.instances.values()]})

    async def list_instances(_request: web.Request) -> web.Response:
        return json_response({"instances": [i.to_json() for i in node.instances.values()]})

    async def load(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "Request body is not valid JSON.") from None
        if not isinstance(body, dict):
            raise ApiError(400, "Request body must be a JSON object.")
        name, path = body.get("name"), body.get("path")
        for key, value in (("name", name), ("path", path)):
            if not isinstance(value, str) or not value:
                raise ApiError(400, f"Missing required parameter: '{key}'.", param=key)
        if name in node.instances:
            raise ApiError(
                409, f"Model '{name}' is already loaded.", param="name", code="model_exists"
            )
        try:
            entry = await asyncio.to_thread(ModelEntry.from_path, name, path, "admin")
        except (CatalogError, CheckpointError) as exc:
            raise ApiError(
                400, str(exc), param="path" if isinstance(exc, CheckpointError) else "name"
            ) from None
        inst = node.add(entry)
        log.info("loaded %s from %s", name, entry.path)
        return json_response(inst.to_json(), 201)

    async def unload(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        await node.remove(name)
        log.info("unloaded %s", name)
        return json_response({"name": name, "unloaded": True})

    async def restart(request: web.Request) -> web.Response:
        inst = node.get(request.match_info["name"])
        inst.restart()
        return json_response(inst.to_json(), 202)

    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/models", load)
    app.router.add_delete("/v1/models/{name}", unload)
    app.router.add_get("/v1/instances", list_instances)
    app.router.add_post("/v1/instances/{name}/restart", restart)
    return app


async def run(args: argparse.Namespace) -> None:
    runtime_dir, data_dir = args.runtime_dir, args.data_dir
    runtime_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
    data_dir.mkdir(parents=True, exist_ok=True)
    config = load_config(args.config) if args.config else None
    entries: list[ModelEntry] = []
    if args.defaults and (config is None or config.default_models):
        entries += await asyncio.to_thread(default_entries, data_dir)
    for model in config.models if config else []:
        if any(e.name == model.name for e in entries):
            raise CatalogError(
                f"{args.config}: model name {model.name!r} is taken by a default model"
            )
        entries.append(ModelEntry.from_path(model.name, model.path, "config", model.limits))

    node = Node(runtime_dir, ready_wait_s=args.ready_wait)
    node.sandbox_factory = sandbox_factory(args.sandbox, runtime_dir, node)
    for entry in entries:
        try:
            node.add(entry)
        except ApiError as exc:
            raise CatalogError(f"model {entry.name!r}: {exc.message}") from None

    runners = []
    inference = web.AppRunner(inference_app(node), handler_cancellation=True, access_log=None)
    await inference.setup()
    await web.TCPSite(inference, args.host, args.port).start()
    runners.append(inference)
    admin_path = paths.admin_socket(runtime_dir)
    admin_path.unlink(missing_ok=True)
    admin = web.AppRunner(admin_app(node), access_log=None)
    await admin.setup()
    await web.UnixSite(admin, str(admin_path)).start()
    os.chmod(admin_path, 0o660)
    runners.append(admin)
    log.info(
        "omnid listening on http://%s:%d, admin socket %s; models: %s",
        args.host,
        args.port,
        admin_path,
        ", ".join(e.name for e in entries) or "none",
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("omnid stopping")
    for runner in runners:
        await runner.cleanup()
    await node.shutdown()
    admin_path.unlink(missing_ok=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="omnid", description=__doc__)
    parser.add_argument("--host", default=env("OMNID_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env("OMNID_PORT", "8081")))
    parser.add_argument("--runtime-dir", type=Path, default=paths.runtime_dir())
    parser.add_argument("--data-dir", type=Path, default=paths.data_dir())
    parser.add_argument(
        "--config",
        type=Path,
        default=env("OMNID_CONFIG"),
        help="TOML config with [[models]] entries",
    )
    parser.add_argument(
        "--no-defaults",
        dest="defaults",
        action="store_false",
        help="do not serve the embedded default models",
    )
    parser.add_argument(
        "--sandbox",
        choices=["auto", "isolated", "process"],
        default=env("OMNI_SANDBOX", "auto"),
        help="isolated: cgroups + namespaces (needs root); auto: isolated when root",
    )
    parser.add_argument(
        "--ready-wait",
        type=float,
        default=30.0,
        help="seconds a request waits for a starting instance before a 503",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging("omnid")
    try:
        asyncio.run(run(args))
    except (CatalogError, CheckpointError) as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
